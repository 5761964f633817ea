"""Torch-TensorRT's autocast gets the recorded calls as calibration data (no GPU needed up to the compile).

Without data its data-range rule keeps no node in fp32; with it, nodes whose outputs overflow the
low type stay in fp32. Torch-TensorRT runs its lowered graph on each batch as flat positional
inputs and concatenates every node's outputs along axis 0, which decides what can be handed over.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from aitune.backend import BuildContext
from aitune.graph import Sample, infer_graph
from aitune_backend_torchtrt.backend import (
    CALIBRATION_FILE,
    TorchTensorRTAotBackend,
    _read_calibration,
    autocast_calibration,
    calibration_batches,
)
from aitune_backend_torchtrt.config import TorchTensorRTAotBackendConfig, TorchTensorRTConfig

RELEASE_WITH_CALIBRATION = frozenset({"enable_autocast", "autocast_calibration_dataloader"})


def _samples(*batches: int, width: int = 8) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    return [Sample((torch.randn(b, width, generator=g),)) for b in batches]


def test_calls_of_the_most_common_shape_are_kept_keyword_calls_are_not():
    samples = _samples(4, 2, 4, 4)
    keyword = Sample((), {"x": torch.randn(4, 8)})
    batches = calibration_batches([*samples, keyword])
    assert len(batches) == 3 and all(b[0].shape == (4, 8) for b in batches)
    assert all(b[0] is s.args[0] for b, s in zip(batches, [samples[0], samples[2], samples[3]]))
    assert calibration_batches([keyword]) == []
    assert calibration_batches([Sample((torch.randn(2, 8), 3))]) == []  # a non-tensor argument is baked in


def test_the_loader_yields_each_recorded_call_as_its_positional_tensors():
    batches = calibration_batches(_samples(4, 4))
    settings, note = autocast_calibration(batches, RELEASE_WITH_CALIBRATION)
    loader = settings["autocast_calibration_dataloader"]
    assert isinstance(loader, torch.utils.data.DataLoader)
    seen = [tuple(batch) for batch in loader]
    assert len(seen) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(seen, batches))
    assert note == "2 recorded call(s) of shapes [[4, 8]]"


def test_no_data_or_a_release_without_the_setting_is_said_in_the_report():
    settings, note = autocast_calibration([], RELEASE_WITH_CALIBRATION)
    assert settings == {} and note.startswith("none: no recorded call passes positional tensors only")
    settings, note = autocast_calibration(calibration_batches(_samples(4)), frozenset({"enable_autocast"}))
    assert settings == {} and "takes no autocast calibration data" in note
    settings, _ = autocast_calibration(calibration_batches(_samples(4)), None)  # settings unreadable: try it
    assert "autocast_calibration_dataloader" in settings


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_an_isolated_build_hands_its_worker_the_calls_in_safetensors(tmp_path: Path, precision: str):
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    samples = _samples(4, 2, 4)
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    config = TorchTensorRTAotBackendConfig(compile_config=TorchTensorRTConfig(enabled_precisions=(precision,)))
    folder = tmp_path / "exported"
    folder.mkdir()
    context = BuildContext(graph, samples, torch.device("cuda"), tmp_path, tmp_path / "cache")
    notes = TorchTensorRTAotBackend(config).export(module, context, folder)
    assert json.loads(json.dumps(notes)) == notes
    if precision == "fp32":  # nothing to calibrate: no file
        assert "calibration" not in notes and not (folder / CALIBRATION_FILE).exists()
        return
    assert notes["calibration"] == {"file": CALIBRATION_FILE, "batches": 2, "tensors": 1}
    worker = BuildContext(graph, [], torch.device("cpu"), tmp_path, tmp_path / "cache")  # the worker saw no samples
    read = _read_calibration(folder, notes, worker)
    assert (
        len(read) == 2 and torch.equal(read[0][0], samples[0].args[0]) and torch.equal(read[1][0], samples[2].args[0])
    )


def test_a_call_recorded_twice_is_written_once_per_batch(tmp_path: Path):
    """The same tensors passed twice share memory, which safetensors refuses: each batch is a copy."""
    module = torch.nn.Linear(8, 8).eval()
    x = torch.randn(4, 8)
    samples = [Sample((x,)), Sample((x,))]
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    fp16 = TorchTensorRTAotBackendConfig(compile_config=TorchTensorRTConfig(enabled_precisions=("fp16",)))
    context = BuildContext(graph, samples, torch.device("cuda"), tmp_path, tmp_path / "cache")
    notes = TorchTensorRTAotBackend(fp16).export(module, context, tmp_path)
    assert notes["calibration"]["batches"] == 2 and (tmp_path / CALIBRATION_FILE).is_file()


class _Compiled(torch.nn.Module):
    def __init__(self, children: list[str]) -> None:
        super().__init__()
        for name in children:
            self.add_module(name, torch.nn.Identity())


def _fake_release(monkeypatch, make_release_settings, children: list[str]) -> dict:
    """A Torch-TensorRT 2.13 stand-in whose compile records its settings and returns ``children``."""
    import sys
    from types import SimpleNamespace

    seen: dict = {}

    Settings = make_release_settings(
        "enable_autocast", "autocast_low_precision_type", "autocast_calibration_dataloader"
    )

    def compile(program, **kwargs):
        seen.update(kwargs)
        return _Compiled(children)

    release = SimpleNamespace(
        __version__="2.13.0",
        Input=lambda **kw: kw,
        dynamo=SimpleNamespace(CompilationSettings=Settings, compile=compile),
    )
    monkeypatch.setitem(sys.modules, "torch_tensorrt", release)
    return seen


def _compile(tmp_path: Path, samples: list[Sample]):
    from aitune_backend_torchtrt.backend import _compile_program

    module = torch.nn.Linear(8, 8).eval()
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    context = BuildContext(graph, samples, torch.device("cuda"), tmp_path, tmp_path / "cache")
    fp16 = TorchTensorRTConfig(enabled_precisions=("fp16",))
    return _compile_program(object(), fp16, context, calibration_batches(samples))  # type: ignore[arg-type]


def test_the_compile_gets_the_recorded_calls_and_the_report_says_so(monkeypatch, make_release_settings, tmp_path):
    seen = _fake_release(monkeypatch, make_release_settings, ["_run_on_acc_0", "_run_on_gpu_0"])
    _, facts = _compile(tmp_path, _samples(4, 4, 2))
    assert seen["enable_autocast"] is True and seen["autocast_low_precision_type"] is torch.float16
    assert len(list(seen["autocast_calibration_dataloader"])) == 2
    assert facts["autocast_calibration"] == "2 recorded call(s) of shapes [[4, 8]]"
    assert facts["tensorrt_subgraphs"] == 1 and facts["pytorch_subgraphs"] == 1


def test_a_compile_that_left_every_node_in_pytorch_fails_instead_of_running_eager(
    monkeypatch, make_release_settings, tmp_path: Path
):
    from aitune.errors import BuildError

    _fake_release(monkeypatch, make_release_settings, ["_run_on_gpu_0"])
    with pytest.raises(BuildError, match="converted no part of the graph to TensorRT"):
        _compile(tmp_path, _samples(4))
