"""The refit's pieces on their own: which weight each initializer holds (folds included), the copy
of the graph with new weights written in (external data included), and the plan in a payload."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from aitune.errors import BuildError
from aitune_backend_onnxruntime.export import (
    BatchNormFold,
    ExportedModel,
    batch_norm_eps,
    plan_value,
    refit_plan,
    write_refit_copy,
)
from aitune_backend_onnxruntime.payload import plan_entry_json, plan_from_metadata


def _conv_norm(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()
    model[1].running_mean.normal_()
    model[1].running_var.uniform_(0.5, 2.0)
    torch.nn.init.normal_(model[1].weight)
    return model


def _graph(tmp_path, initializers, *, external=False):
    """A graph whose outputs are its initializers (enough for the plan and the copy)."""
    inits = [numpy_helper.from_array(np.array(a, order="C"), name) for name, a in initializers.items()]
    outputs = [helper.make_tensor_value_info(f"out_{n}", onnx.TensorProto.FLOAT, None) for n in initializers]
    nodes = [helper.make_node("Identity", [n], [f"out_{n}"]) for n in initializers]
    graph = helper.make_graph(nodes, "g", [], outputs, inits)
    path = tmp_path / "model.onnx"
    onnx.save_model(
        helper.make_model(graph), str(path), save_as_external_data=external, all_tensors_to_one_file=True,
        location="model.onnx.data", size_threshold=0,
    )  # fmt: skip
    files = ["model.onnx", "model.onnx.data"] if external else ["model.onnx"]
    return ExportedModel(tmp_path, files, (), (), None, {})


def test_a_layer_folded_with_its_batch_norm_is_mapped_as_a_fold_not_by_its_name(tmp_path):
    """The exporters keep a folded convolution under the layer's own name: mapping it by name would
    refit the raw weight into the folded slot."""
    model = _conv_norm(0)
    weights = model.state_dict()
    scale = weights["1.weight"] / torch.sqrt(weights["1.running_var"] + 1e-5)
    folded_w = (weights["0.weight"] * scale.reshape(-1, 1, 1, 1)).numpy()
    folded_b = ((weights["0.bias"] - weights["1.running_mean"]) * scale + weights["1.bias"]).numpy()
    _graph(tmp_path, {"module.0.weight": folded_w, "val_3": folded_b})
    plan = refit_plan(tmp_path / "model.onnx", weights, batch_norm_eps(model))
    assert plan == {
        "module.0.weight": BatchNormFold("weight", "0.weight", "1", 1e-5, 0),
        "val_3": BatchNormFold("bias", "0.bias", "1", 1e-5, 0),
    }
    assert refit_plan(tmp_path / "model.onnx", weights) == {}, "without the norms' eps nothing is guessed"
    new = _conv_norm(1)
    fresh = torch.nn.utils.fusion.fuse_conv_bn_eval(new[0], new[1])
    for name, want in (("module.0.weight", fresh.weight), ("val_3", fresh.bias)):
        got = plan_value(plan[name], new.state_dict())
        assert got is not None and float((got - want.detach()).abs().max()) <= 1e-5 * float(want.detach().abs().max())
    assert plan_value(plan["val_3"], {"0.bias": new[0].bias}) is None, "a missing statistic refits nothing"


def test_the_refit_copy_writes_external_data_at_its_offsets_and_leaves_the_export_alone(tmp_path):
    source = tmp_path / "export"
    source.mkdir()
    a, b = np.arange(12, dtype=np.float32).reshape(3, 4), np.ones(5, np.float32)
    exported = _graph(source, {"a": a, "b": b}, external=True)
    before = (source / "model.onnx.data").read_bytes()
    model, files = write_refit_copy(exported, {"b": np.full(5, 7, np.float32)}, tmp_path / "refit")
    assert model == tmp_path / "refit" / "model.onnx" and files == ["model.onnx", "model.onnx.data"]
    assert (source / "model.onnx.data").read_bytes() == before, "the export keeps the old weights"
    loaded = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(model)).graph.initializer}
    assert np.array_equal(loaded["a"], a) and np.array_equal(loaded["b"], np.full(5, 7, np.float32))
    assert all(
        i.data_location == onnx.TensorProto.EXTERNAL
        for i in onnx.load(str(model), load_external_data=False).graph.initializer
    )
    with pytest.raises(BuildError, match="initializer 'b'"):
        write_refit_copy(exported, {"b": np.ones(6, np.float32)}, tmp_path / "wrong-shape")
    with pytest.raises(BuildError, match="no initializer 'c'"):
        write_refit_copy(exported, {"c": np.ones(6, np.float32)}, tmp_path / "unknown")


def test_the_plan_survives_the_payload_and_junk_in_it_is_dropped():
    plan = {"w": ("0.weight", True), "f": BatchNormFold("bias", None, "1", 1e-3, 0)}
    saved = {name: plan_entry_json(entry) for name, entry in plan.items()}
    assert plan_from_metadata(saved) == plan
    junk = {
        "x": {
            "fold": "batch_norm",
            "part": "weight",
            "layer": None,
            "norm": "1",
            "eps": 1e-5,
        },  # a weight needs a layer
        "y": {"fold": "batch_norm", "part": "bias", "layer": None, "norm": "1", "eps": "1e-5"},
        "z": {"fold": "other"},
        "v": ["0.weight", "yes"],
    }
    assert plan_from_metadata(junk) == {}


def test_a_scalar_weight_maps_by_its_name_and_a_constant_never_by_its_value(tmp_path):
    weights = {"scale": torch.tensor(1.0), "w": torch.arange(6.0).reshape(2, 3)}
    _graph(
        tmp_path,
        {
            "module.scale": np.float32(1.0),
            "one": np.float32(1.0),
            "w_t": np.arange(6.0, dtype=np.float32).reshape(2, 3).T,
        },
    )
    assert refit_plan(tmp_path / "model.onnx", weights) == {"module.scale": ("scale", False), "w_t": ("w", True)}


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_an_external_data_export_is_refitted_through_a_patched_copy(tmp_path, exporter):
    """Weights kept in ``model.onnx.data`` (a model past 1 GiB, or ``external_data=True``): the refit
    patches a copy of that file, and the session serves the new weights, folds included."""
    from aitune.backend import BuildContext
    from aitune.graph import Sample, infer_graph
    from aitune.onnx_export import ONNXExportConfig
    from aitune.testing import assert_matches_eager
    from aitune_backend_onnxruntime.backend import ONNXRuntimeBackend
    from aitune_backend_onnxruntime.config import ONNXRuntimeBackendConfig

    def model(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(_conv_norm(seed), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3)).eval()
        return m

    module = model(0)
    samples = [Sample((torch.randn(b, 3, 8, 8),)) for b in (2, 4)]
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    export = ONNXExportConfig(exporter=exporter, external_data=True, fallback_to_torchscript=False)
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(export=export))
    with torch.no_grad():
        backend.build(module, BuildContext(graph, samples, torch.device("cpu"), tmp_path, tmp_path))
    exported = backend.exported
    assert len(exported.files) == 2, "the weights are in an external-data file"
    data = (exported.folder / exported.files[1]).read_bytes()
    fresh = model(1)
    assert backend.refit(fresh.state_dict())
    assert (exported.folder / exported.files[1]).read_bytes() == data, "the export keeps the old weights"
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        assert_matches_eager(backend.infer(x), fresh(x))
    first = backend._refit_dir
    assert backend.refit(model(2).state_dict()) and backend._refit_dir != first and not first.exists()
    with torch.no_grad():
        assert_matches_eager(backend.infer(x), model(2)(x))
