"""A fresh process that loads an artifact imports what that artifact's payloads need, nothing more
(issue 56): a service's cold start pays for no other backend's plugin, no exporter, no quantizer."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

import aitune.torch as ait
from aitune.plugins import get_manager
from aitune.testing.conformance import run_in_fresh_process

OTHER_PLUGINS = ("aitune_backend_tensorrt", "aitune_backend_torchao", "aitune_backend_torchtrt", "aitune_executor_ray")
NEVER_AT_LOAD = (
    "torchao",
    "onnx",
    "onnxscript",
    "transformers",
    "torch._dynamo",
    "torch._inductor",
    "ray",
    "kserve",
    "packaging",  # the backend's requirements are plain releases, checked without it
)
"""What no load of these artifacts needs: quantizers, exporters, compilers, servers, a version parser."""
TUNER = (
    "aitune.engine.tuner",
    "aitune.engine.strategies",
    "aitune.engine.graph_tuning",
    "aitune.artifact.writer",
    "aitune.report",
    "aitune.validation",
    "aitune.profiling",
)
"""aitune's own modules a load never needs: the tuner, its strategies and steps, the writer, the tuning
report's classes, the candidate check and the profiler (a load's own check imports them when it runs)."""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()


def _artifact(backend: str, folder: Path) -> tuple[Path, str]:
    registry = get_manager().registry
    if backend not in registry or registry.status(backend).reason("cpu"):
        pytest.skip(f"{backend} cannot run here")
    chosen = registry.backend_class(backend)(registry.config_class(backend)())
    model = ait.Module(_model(), "mlp", strategy=ait.OneBackendStrategy(chosen, performance_validation=False))
    ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
    assert [b.name for _, b in model.tuned_graphs] == [backend]
    path = ait.save(model, folder / f"{backend}.ait")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def _load_in_fresh_process(path: Path, pinned: str) -> dict:
    return run_in_fresh_process(
        f"""
        import json, sys, torch
        import aitune.torch as ait
        from aitune.plugins import get_manager

        get_manager()
        before = sorted(m for m in sys.modules if m.startswith(("aitune_backend_", "aitune_executor_")))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
        x = torch.randn(3, 8)
        with torch.no_grad():
            eager = model(x)
        model = ait.load(model, {str(path)!r}, expected_sha256={pinned!r})
        with torch.no_grad():
            tuned = model(x)
        print(json.dumps({{
            "picked": [b.name for _, b in model.tuned_graphs],
            "close": torch.allclose(tuned, eager, rtol=1e-4, atol=1e-5),
            "plugins_before_load": before,
            "modules": sorted(sys.modules),
        }}))
        """
    )


def _under(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == n or m.startswith(n + ".") for n in names)]


def test_loading_an_onnx_runtime_artifact_imports_no_quantizer_exporter_or_other_plugin(tmp_path):
    path, pinned = _artifact("onnxruntime", tmp_path)
    got = _load_in_fresh_process(path, pinned)
    assert got["picked"] == ["onnxruntime"] and got["close"]
    assert got["plugins_before_load"] == [], "the manager imports no plugin until a backend is looked up"
    assert _under(got["modules"], (*NEVER_AT_LOAD, *TUNER)) == []
    assert _under(got["modules"], (*OTHER_PLUGINS, "aitune_backend_inductor")) == []
    assert "onnxruntime" in got["modules"]


def test_loading_an_aotinductor_artifact_imports_no_onnx_runtime_quantizer_or_compiler(tmp_path):
    path, pinned = _artifact("torch_inductor_aot", tmp_path)
    got = _load_in_fresh_process(path, pinned)
    assert got["picked"] == ["torch_inductor_aot"] and got["close"]
    assert got["plugins_before_load"] == []
    assert _under(got["modules"], (*NEVER_AT_LOAD, *TUNER, "onnxruntime")) == []
    assert _under(got["modules"], (*OTHER_PLUGINS, "aitune_backend_onnxruntime")) == []
