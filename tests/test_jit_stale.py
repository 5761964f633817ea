"""A JIT decision remembered across runs never outlives the code it was made for.

The script runs twice in fresh interpreters with ``AITUNE_JIT=1`` and one cache dir; between the
runs its ``forward`` changes and its weights do not. ONNX Runtime bakes the traced code into its
payload, so reusing the first run's winner would return the old forward's outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("aitune_backend_onnxruntime")
pytest.importorskip("onnxruntime")

SCRIPT = """
import aitune.torch.jit.enable  # noqa: F401  (AITUNE_JIT=1 does the same through the installed .pth)
import json
import torch
from aitune.torch import jit
from aitune.engine.recording import bypass

from aitune.torch import FirstWinsStrategy
from aitune.torch.backend import ONNXRuntimeBackend

# the gate off: the test is about which decision is remembered, not about who wins a timing race
jit.config.strategy = FirstWinsStrategy([ONNXRuntimeBackend()], performance_validation=False)
jit.config.min_parameters = 0
jit.config.min_samples = 2


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.out(torch.relu(self.proj(x))) * SCALE


torch.manual_seed(0)
model = Encoder().eval()
x = torch.randn(4, 16)
with torch.no_grad():
    for _ in range(4):
        y = model(x)
    with bypass():
        eager = model(x)
print(json.dumps({
    "decisions": [(d.name, d.outcome, d.from_cache, d.backends) for d in jit.decisions()],
    "error": float((y - eager).abs().max()),
    "scale": float(eager.abs().max()),
}))
"""


def _run(script: Path, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITUNE_JIT")}
    env.update(AITUNE_JIT="1", AITUNE_JIT_MODE="inline", AITUNE_CACHE_DIR=str(cache))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_changed_forward_is_tuned_again_and_matches_eager(tmp_path: Path) -> None:
    script = tmp_path / "encoder.py"
    script.write_text(SCRIPT.replace("SCALE", "1.0"))
    first = _run(script, tmp_path / "cache")
    assert first["decisions"] == [["Encoder", "tuned", False, ["onnxruntime"]]]
    assert first["error"] <= 1e-4 * first["scale"]

    script.write_text(SCRIPT.replace("SCALE", "2.0"))
    second = _run(script, tmp_path / "cache")
    assert second["decisions"] == [["Encoder", "tuned", False, ["onnxruntime"]]]  # a new key: not reused
    assert second["error"] <= 1e-4 * second["scale"]  # the new forward's outputs, not the old ones

    third = _run(script, tmp_path / "cache")  # unchanged code: the decision is reused
    assert third["decisions"] == [["Encoder", "tuned", True, ["onnxruntime"]]]
    assert third["error"] <= 1e-4 * third["scale"]
