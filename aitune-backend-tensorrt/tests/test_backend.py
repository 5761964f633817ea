"""The backend on a machine without TensorRT or CUDA: honest refusals, config, tolerances."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aitune.backend import BuildContext, LoadContext
from aitune.errors import ArtifactError, BackendUnavailableError, ConfigError
from aitune.graph import Sample
from aitune.testing import TinyMLP, tiny_samples
from aitune_backend_tensorrt import compat
from aitune_backend_tensorrt.backend import METADATA_VERSION, PLAN_FILE, TensorRTBackend
from aitune_backend_tensorrt.compat import Machine
from aitune_backend_tensorrt.config import (
    ModelOptQuantizationConfig,
    ONNXAutoCastConfig,
    TensorRTBackendConfig,
    TensorRTProfile,
)

NO_CUDA_HERE = not torch.cuda.is_available()


def test_config_round_trips_through_json_with_profiles_and_precision():
    from aitune.testing import config_from_json, config_to_json

    for quantization in (None, ONNXAutoCastConfig(low_precision_type="bf16"), ModelOptQuantizationConfig(mode="fp8")):
        config = TensorRTBackendConfig(
            profiles=[
                TensorRTProfile(shapes={"input_ids": ((1, 1), (8, 64), (8, 128))}),
                TensorRTProfile(shapes={"input_ids": ((1, 129), (2, 256), (8, 512))}),
            ],
            quantization_config=quantization,
            workspace_size=1 << 30,
            optimization_level=5,
            use_cuda_graphs=True,
        )
        data = json.loads(json.dumps(config_to_json(config)))
        assert data["backend"] == "tensorrt"
        assert config_from_json(data) == config


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: TensorRTProfile(shapes={"x": ((4, 16), (2, 16), (8, 16))}), "min <= opt <= max"),
        (lambda: TensorRTProfile(shapes={"x": ((1, 16), (2, 16))}), r"\(min, opt, max\)"),
        (lambda: TensorRTBackendConfig(builder_flags=["FP16"]), "strongly_typed=False"),
        (lambda: TensorRTBackendConfig(builder_flags=["FAST"]), "unknown"),
    ],
)
def test_invalid_configs_are_refused_with_the_fix(make, message):
    with pytest.raises(ConfigError, match=message):
        make()
    TensorRTBackendConfig(strongly_typed=False, builder_flags=["FP16"])  # the weakly typed way is allowed


def test_public_names_resolve_through_aitune_torch_backend():
    from aitune.torch import backend

    assert backend.TensorRTBackend is TensorRTBackend
    assert backend.TensorRTProfile is TensorRTProfile
    assert backend.ONNXAutoCastConfig is ONNXAutoCastConfig
    assert backend.ModelOptQuantizationConfig is ModelOptQuantizationConfig


@pytest.mark.skipif(not NO_CUDA_HERE, reason="checks the report of a machine without CUDA")
def test_aitune_backends_says_why_tensorrt_cannot_run_here():
    out = subprocess.run(
        [sys.executable, "-m", "aitune", "backends", "--json"], capture_output=True, text=True, check=True
    )
    (row,) = [r for r in json.loads(out.stdout) if r["backend"] == "tensorrt"]
    assert row["status"] == "unavailable"
    assert "no CUDA device" in row["devices"]["cuda"]
    if not compat.installed_tensorrt()[0]:
        assert "TensorRT is not installed" in row["devices"]["cuda"]


def _context(tmp_path: Path, device: str) -> BuildContext:
    module = TinyMLP().eval()
    samples = tiny_samples((2, 4))
    with torch.no_grad():
        outputs = [module(*s.args) for s in samples]
    from aitune.graph import infer_graph

    graph = infer_graph(samples, ["x"], outputs=outputs)
    return BuildContext(graph, samples, torch.device(device), tmp_path / "work", tmp_path / "cache")


@pytest.mark.skipif(not NO_CUDA_HERE, reason="checks the refusal on a machine without CUDA")
def test_building_without_cuda_raises_unavailable_with_the_reason(tmp_path):
    backend = TensorRTBackend()
    with pytest.raises(BackendUnavailableError, match="no CUDA device is visible"):
        backend.build(TinyMLP().eval(), _context(tmp_path, "cuda"))
    with pytest.raises(BackendUnavailableError, match="CUDA devices only"):
        backend.build(TinyMLP().eval(), _context(tmp_path, "cpu"))
    assert "tensorrt" not in sys.modules


def test_unsupported_graphs_are_named_before_any_build(tmp_path, make_graph):
    backend = TensorRTBackend()
    graph = _context(tmp_path, "cpu").graph
    assert backend.unsupported_reason(graph, torch.device("cuda")) is None
    assert "CUDA devices only" in backend.unsupported_reason(graph, torch.device("cpu"))
    double = make_graph(TinyMLP().double().eval(), [Sample((torch.randn(2, 16, dtype=torch.float64),))], ["x"])
    assert "float64" in backend.unsupported_reason(double, torch.device("cuda"))


def test_tolerance_follows_the_precision():
    assert TensorRTBackend(TensorRTBackendConfig(tf32=False)).tolerance(torch.float32) is None
    tf32 = TensorRTBackend().tolerance(torch.float32)
    fp16 = TensorRTBackend(TensorRTBackendConfig(quantization_config=ONNXAutoCastConfig())).tolerance(torch.float32)
    int8 = TensorRTBackend(TensorRTBackendConfig(quantization_config=ModelOptQuantizationConfig())).tolerance(
        torch.float32
    )
    assert tf32.rtol < fp16.rtol < int8.rtol
    assert TensorRTBackend().tolerance(torch.int64) is None


def _metadata(**changes: object) -> dict:
    meta = {
        "metadata_version": METADATA_VERSION,
        "plan": PLAN_FILE,
        "tensorrt_version": "10.9.0.34",
        "gpu_name": "NVIDIA A100",
        "compute_capability": [8, 0],
        "hardware_compatible": False,
        "version_compatible": False,
        "precision": "as exported (strongly typed)",
        "profiles": [{"x": [[2, 16], [2, 16], [4, 16]]}],
        "inputs": [{"name": "x", "path": "x", "dtype": "float32"}],
        "outputs": [{"name": "output", "path": "output", "dtype": "float32"}],
    }
    meta.update(changes)
    return meta


def test_load_refuses_an_incompatible_machine_before_tensorrt_reads_the_plan(tmp_path, monkeypatch):
    graph = _context(tmp_path, "cpu").graph
    (tmp_path / PLAN_FILE).write_bytes(b"not a plan: TensorRT must never see it")

    def load(meta: dict, device: str = "cuda") -> None:
        TensorRTBackend().load(TinyMLP(), tmp_path, LoadContext(graph, torch.device(device), meta, tmp_path))

    with pytest.raises(BackendUnavailableError, match="CUDA devices only"):
        load(_metadata(), "cpu")
    monkeypatch.setattr(compat, "this_machine", lambda index=None: Machine("10.9.0.34", cuda=False))
    with pytest.raises(BackendUnavailableError, match="no CUDA device"):
        load(_metadata())
    monkeypatch.setattr(compat, "this_machine", lambda index=None: Machine("11.1.0", True, "NVIDIA A100", (8, 0)))
    with pytest.raises(ArtifactError, match="major"):
        load(_metadata())
    monkeypatch.setattr(compat, "this_machine", lambda index=None: Machine("10.9.0", True, "NVIDIA L4", (8, 9)))
    with pytest.raises(ArtifactError, match=r"compute capability 8\.9"):
        load(_metadata())
    with pytest.raises(ArtifactError, match="metadata version"):
        load(_metadata(metadata_version=99))
    assert "tensorrt" not in sys.modules


def test_save_before_build_is_an_error(tmp_path):
    with pytest.raises(ArtifactError, match="before build"):
        TensorRTBackend().save(tmp_path)
