"""The CUDA presets, end to end on a GPU (skipped visibly without one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aitune.backend import BuildContext, LoadContext
from aitune.graph import Sample, infer_graph
from aitune.validation import validate
from aitune_backend_torchao.backend import TorchAOBackend
from aitune_backend_torchao.config import TorchAOBackendConfig


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("preset", "compile"), [("int4wo", False), ("fp8wo", False), ("fp8dq", False), ("int8dq", False), ("int8dq", True)]
)
def test_cuda_preset_builds_validates_and_reloads(preset: str, compile: bool, tmp_path: Path) -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    # bfloat16, and widths the int4 group size (128) divides: what the int4 kernel needs
    module = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    module = module.to(device, torch.bfloat16).eval()
    samples = [Sample((torch.randn(b, 256, device=device, dtype=torch.bfloat16),)) for b in (2, 8)]
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    backend = TorchAOBackend(TorchAOBackendConfig(quantization=preset, compile=compile))
    reason = backend.unsupported_reason(graph, device)
    if reason and preset in ("int4wo", "fp8dq"):
        pytest.skip(reason)  # an older GPU: the reason is the point
    assert reason is None

    backend.build(module, BuildContext(graph, samples, device, tmp_path, tmp_path))
    report = validate(backend, module, samples, graph)
    assert report.passed, report.reason

    payload = tmp_path / "payload"
    payload.mkdir()
    metadata = backend.save(payload)
    assert metadata["weights"] == "safetensors"
    loaded = TorchAOBackend(backend.config)
    loaded.load(module, payload, LoadContext(graph, device, metadata, tmp_path))
    for s in samples:
        torch.testing.assert_close(loaded.infer(*s.args), backend.infer(*s.args), rtol=0, atol=0)
