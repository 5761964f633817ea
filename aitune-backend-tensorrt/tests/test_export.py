"""The half of an isolated build that runs in the user's process, on CPU: ``export`` writes the ONNX
model and JSON notes a worker builds the engine from; ``build_exported`` on a machine without
TensorRT refuses before importing it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from aitune.backend import BuildContext
from aitune.errors import BackendUnavailableError, BuildError, ConfigError
from aitune.testing import assert_matches_eager
from aitune_backend_tensorrt import compat
from aitune_backend_tensorrt.backend import TensorRTBackend
from aitune_backend_tensorrt.config import ONNXAutoCastConfig, TensorRTBackendConfig, TensorRTProfile

CUDA = torch.device("cuda")  # the device the engine is for; nothing here touches it


def _context(graph, samples, tmp_path: Path, device: torch.device = CUDA) -> BuildContext:
    (tmp_path / "work").mkdir(exist_ok=True)
    return BuildContext(graph, samples, device, tmp_path / "work", tmp_path / "cache")


@pytest.fixture(scope="module")
def exported(two_inputs, tmp_path_factory: pytest.TempPathFactory):
    """TwoInputs (batch and sequence axes, dict output) exported once by the backend."""
    module, samples, graph = two_inputs
    tmp = tmp_path_factory.mktemp("export")
    with torch.no_grad():
        notes = TensorRTBackend().export(module, _context(graph, samples, tmp), tmp / "exported")
    return notes, tmp / "exported"


def test_notes_are_json_and_carry_names_profiles_and_dtypes(exported, two_inputs) -> None:
    notes, _ = exported
    _, _, graph = two_inputs
    assert json.loads(json.dumps(notes)) == notes
    assert notes["input_names"] == ["input_ids", "mask"]
    # samples (2, 5), (4, 7), (4, 7), (3, 12): min, the most common shape as opt, max
    assert notes["profiles"] == [
        {"input_ids": [[2, 5], [4, 7], [4, 12]], "mask": [[2, 5], [4, 7], [4, 12]]},
    ]
    assert notes["inputs"] == [
        {"name": "input_ids", "path": graph.inputs[0].path, "dtype": "int64"},
        {"name": "mask", "path": graph.inputs[1].path, "dtype": "float32"},
    ]
    assert [o["dtype"] for o in notes["outputs"]] == ["float32", "float32"]
    assert len({o["name"] for o in notes["outputs"]}) == 2
    assert notes["precision"] == "as exported (strongly typed)"
    assert notes["export"]["onnx_exporter"] in ("dynamo", "torchscript")
    assert "tensorrt" not in sys.modules


def test_the_listed_files_alone_are_the_model(exported, two_inputs, tmp_path: Path) -> None:
    """Copied elsewhere, the files the notes list run the module at a shape no sample had."""
    import onnxruntime as ort

    notes, folder = exported
    module, _, graph = two_inputs
    assert notes["onnx"] in notes["files"]
    assert sorted(p.name for p in folder.iterdir()) == sorted(notes["files"])
    for name in notes["files"]:
        shutil.copyfile(folder / name, tmp_path / name)
    session = ort.InferenceSession(str(tmp_path / notes["onnx"]), providers=["CPUExecutionProvider"])
    ids, mask = torch.randint(0, 50, (3, 9), generator=torch.Generator().manual_seed(4)), torch.ones(3, 9)
    got = session.run([o["name"] for o in notes["outputs"]], {"input_ids": ids.numpy(), "mask": mask.numpy()})
    with torch.no_grad():
        want = module(ids, mask)
    assert_matches_eager(graph.unflatten_outputs([torch.from_numpy(g) for g in got]), want)


def test_autocast_writes_the_fp16_model_the_worker_builds_from(tmp_path: Path, make_graph) -> None:
    pytest.importorskip("modelopt.onnx.autocast", reason="ModelOpt's ONNX tools are in this member's [test] extra")
    import onnx

    from aitune.testing import TinyMLP, tiny_samples

    module, samples = TinyMLP().eval(), tiny_samples((2, 4, 3))
    backend = TensorRTBackend(TensorRTBackendConfig(quantization_config=ONNXAutoCastConfig()))
    with torch.no_grad():
        notes = backend.export(module, _context(make_graph(module, samples, ["x"]), samples, tmp_path), tmp_path / "x")
    assert notes["onnx"] == "model.fp16.onnx" and notes["onnx"] in notes["files"]
    assert "fp16" in notes["precision"] and notes["export"]["precision_seconds"] >= 0
    model = onnx.load(str(tmp_path / "x" / notes["onnx"]))
    assert any(init.data_type == onnx.TensorProto.FLOAT16 for init in model.graph.initializer)
    assert not list((tmp_path / "x").rglob("*.npz")), "calibration data stays in the scratch folder"
    assert list((tmp_path / "work").rglob("*.npz")), "AutoCast was calibrated on the recorded samples"


def test_export_refuses_before_exporting(two_inputs, tmp_path: Path) -> None:
    module, samples, graph = two_inputs
    narrow = TensorRTProfile(shapes={graph.inputs[0].path: ((2, 5), (2, 5), (2, 7))})
    with pytest.raises(ConfigError, match="no optimisation profile contains"):
        TensorRTBackend(TensorRTBackendConfig(profiles=[narrow])).export(
            module, _context(graph, samples, tmp_path), tmp_path / "a"
        )
    with pytest.raises(BackendUnavailableError, match="CUDA devices only"):
        TensorRTBackend().export(module, _context(graph, samples, tmp_path, torch.device("cpu")), tmp_path / "b")
    with pytest.raises(BuildError, match="at least one recorded sample"):
        TensorRTBackend().export(module, _context(graph, [], tmp_path), tmp_path / "c")
    assert not any((tmp_path / name).exists() for name in "abc")


@pytest.mark.skipif(compat.availability_reason("cuda") is None, reason="checks the refusal where TensorRT cannot run")
def test_build_exported_without_tensorrt_refuses_without_importing_it(exported, two_inputs, tmp_path: Path) -> None:
    notes, folder = exported
    _, _, graph = two_inputs
    with pytest.raises(BackendUnavailableError, match="cannot build here"):
        TensorRTBackend.build_exported(TensorRTBackendConfig(), folder, notes, _context(graph, [], tmp_path), tmp_path)
    assert "tensorrt" not in sys.modules
    assert not list(tmp_path.glob("*.plan"))
