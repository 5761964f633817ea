"""The runner on its own: an ONNX file opened by ONNX Runtime on the CPU, with no export and no backend."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from aitune.errors import BuildError
from aitune.graph import Sample, infer_graph
from aitune.testing import assert_matches_eager
from aitune_backend_onnxruntime.config import ONNXExecutionProvider, ONNXRuntimeBackendConfig
from aitune_backend_onnxruntime.export import ExportedModel, write_refit_copy
from aitune_backend_onnxruntime.runner import ORTRunner, host_array

CPU = torch.device("cpu")


@pytest.fixture
def linear(tmp_path):
    """A Linear exported by hand, its weight an initializer named ``weight``."""
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 4).eval()
    path = tmp_path / "linear.onnx"
    torch.onnx.export(
        module, (torch.zeros(2, 8),), str(path), dynamo=False, input_names=["x"], output_names=["y"],
        dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, do_constant_folding=False,
    )  # fmt: skip
    return module, path


def _runner(tmp_path, notes=None):
    graph = infer_graph([Sample((torch.zeros(2, 8),)), Sample((torch.zeros(3, 8),))], ["x"])
    config = ONNXRuntimeBackendConfig(intra_op_num_threads=1)
    return ORTRunner(
        config, graph, CPU, ONNXExecutionProvider.CPU, tmp_path, ("x",), ("y",), {} if notes is None else notes
    )


def test_a_runner_runs_an_onnx_file_and_notes_what_it_chose(linear, tmp_path):
    module, path = linear
    notes = {}
    runner = _runner(tmp_path, notes)
    runner.open(path, [path.name])
    x = torch.randn(5, 8)
    with torch.no_grad():
        assert_matches_eager(runner.run([x])[0], module(x))
    assert notes["threads"] == 1 and notes["provider"] == "cpu" and notes["io_binding"] is False
    assert notes["session_providers"] == ["CPUExecutionProvider"]


def test_a_failed_open_keeps_what_ran_before(linear, tmp_path):
    module, path = linear
    runner = _runner(tmp_path)
    runner.open(path, [path.name])
    before = runner.inference
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an onnx graph")
    with pytest.raises(BuildError, match="could not create a session"):
        runner.open(broken, [broken.name])
    assert runner.inference is before
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert_matches_eager(runner.run([x])[0], module(x))


def test_a_copy_shares_onnx_runtime_until_it_opens_new_weights(linear, tmp_path):
    """A deep copy of a tuned module copies its runner: ONNX Runtime's objects are shared, and
    opening the copy on a graph with new initializers (a refit) leaves the original running the old ones."""
    module, path = linear
    runner = _runner(tmp_path)
    runner.open(path, [path.name])
    twin = copy.deepcopy(runner)
    assert twin.inference is runner.inference and twin.out_shapes is not runner.out_shapes
    doubled = (module.weight.detach() * 2).numpy().astype(np.float32)
    exported = ExportedModel(path.parent, [path.name], ("x",), ("y",), None, {}, model=path.name)
    twin.open(*write_refit_copy(exported, {"weight": doubled}, tmp_path / "refit"))
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert_matches_eager(runner.run([x])[0], module(x))
        assert_matches_eager(twin.run([x])[0], torch.nn.functional.linear(x, module.weight * 2, module.bias))
    assert twin.inference is not runner.inference


def test_host_tensors_reach_onnx_runtime_as_views_where_they_can_and_as_contiguous_copies_else(linear, tmp_path):
    module, path = linear
    x = torch.randn(8, 3)
    assert np.shares_memory(host_array(x), x.numpy())
    for awkward in (x.t(), x.t().clone().requires_grad_()):  # not contiguous; needs grad (an eager caller's)
        array = host_array(awkward)
        assert array.flags.c_contiguous and array.tolist() == awkward.tolist()
    runner = _runner(tmp_path)
    runner.open(path, [path.name])
    with torch.no_grad():
        assert_matches_eager(runner.run([x.t()])[0], module(x.t()))
