"""Every backend that runs here, through the real entry points: tune, save, load in a fresh process."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import aitune.torch as ait
from aitune.plugins import get_manager
from aitune.testing import assert_matches_eager

CANDIDATES = {
    "onnxruntime": {},
    "torch_inductor_aot": {},
    "torch_inductor_jit": {},
    "torchao": {"quantization": "int8wo", "compile": False},
}

PIPELINE = """
import torch


class Block(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))

    def forward(self, x):
        return self.net(x) + x


def build(names):
    import aitune.torch as ait
    return {name: ait.Module(Block(i).eval(), name) for i, name in enumerate(names)}


def run(pipe, x):
    for name in sorted(pipe):
        x = pipe[name](x)
    return x
"""


@pytest.fixture(scope="module")
def available() -> list[str]:
    registry = get_manager().registry
    names = [n for n in CANDIDATES if n in registry and not registry.status(n).reason("cpu")]
    if not names:
        pytest.skip("no backend besides eager can run here")
    return names


def test_every_backend_round_trips_through_an_artifact(available, tmp_path: Path, monkeypatch):
    (tmp_path / "pipeline_mod.py").write_text(PIPELINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import pipeline_mod

    registry = get_manager().registry
    pipe = pipeline_mod.build(available)
    for name, wrapped in pipe.items():
        config = registry.config_class(name)(**CANDIDATES[name])
        backend = registry.backend_class(name)(config)
        wrapped.strategy = ait.OneBackendStrategy(backend).enable_performance_validation(False)
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(b, 16, generator=g) for b in (2, 8)]
    report = ait.tune(lambda x: pipeline_mod.run(pipe, x), data)
    assert {m.name: m.graphs[0].decision for m in report.modules} == {n: n for n in available}
    x = torch.randn(5, 16, generator=g)  # a batch size never recorded, inside the tuned range
    with torch.no_grad():
        eager = x
        for name in sorted(pipe):
            eager = pipe[name].module(eager)
        tuned = pipeline_mod.run(pipe, x)
    torch.testing.assert_close(tuned, eager, rtol=0.05, atol=0.05)

    artifact = ait.save(pipe, tmp_path / "pipeline.ait")
    pinned = hashlib.sha256(artifact.read_bytes()).hexdigest()  # AOTInductor and TensorRT run only when trusted
    torch.save(x, tmp_path / "x.pt")
    code = textwrap.dedent(
        f"""
        import json, sys, torch
        sys.path.insert(0, {str(tmp_path)!r})
        import aitune.torch as ait, pipeline_mod
        pipe = ait.load(pipeline_mod.build({available!r}), {str(artifact)!r}, expected_sha256={pinned!r})
        with torch.no_grad():
            y = pipeline_mod.run(pipe, torch.load({str(tmp_path / "x.pt")!r}, weights_only=True))
        states = {{n: m.state for n, m in pipe.items()}}
        compiled = {{n: m.tuned_graphs[0][1].build_info.get("compiled_on_load") for n, m in pipe.items()}}
        print(json.dumps({{"y": y.tolist(), "states": states, "compiled": compiled}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["states"].values()) == {"tuned"}
    assert_matches_eager(torch.tensor(result["y"]), tuned)
    if "torch_inductor_aot" in available:
        assert result["compiled"]["torch_inductor_aot"] is False, "an AOT payload loads without compiling"


def test_the_eager_attention_variant_on_a_model_without_attention_is_not_applicable_not_failed():
    """The issue's report full of failures by design: ONNX Runtime's attention variant on an MLP."""
    registry = get_manager().registry
    if "onnxruntime" not in registry or registry.status("onnxruntime").reason("cpu"):
        pytest.skip("onnxruntime cannot run here")
    from aitune.render import render_markdown
    from aitune.torch.backend import ONNXRuntimeBackend, ONNXRuntimeBackendConfig

    attention, dynamo = ONNXRuntimeBackendConfig(attention="eager"), ONNXRuntimeBackendConfig()
    strategy = ait.FirstWinsStrategy([ONNXRuntimeBackend(attention), ONNXRuntimeBackend(dynamo)])
    strategy.enable_performance_validation(False)
    torch.manual_seed(0)
    model = ait.Module(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval(), "mlp", strategy=strategy)
    report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], end_to_end=False)
    not_applicable, chosen = report.modules[0].graphs[0].candidates
    assert (not_applicable.status, not_applicable.stage) == ("not applicable", "build"), not_applicable.reason
    assert "applies to transformers models only" in not_applicable.reason
    assert chosen.status == "selected" and model.state == "tuned"
    assert "attention" not in report.modules[0].summary, report.modules[0].summary
    assert "| onnxruntime (eager attention) | not applicable (build) |" in render_markdown(report)
