"""The model the kserve engine's tests serve, importable by name in the server's process
(``--factory kserve_testmodel:build``): two named outputs, so a client can select one."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

FEATURES = 16
LENGTH = 8
BATCH_SIZES = (2, 4)
"""Tuned for batches of 2 to 4 rows of length 8."""
SLOW_S = 1.0


class TwoHeads(torch.nn.Module):
    """``x: [batch, 8, 16]`` to ``{"logits": [batch, 4], "pooled": [batch, 32]}``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(FEATURES, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        pooled = torch.nn.functional.gelu(self.proj(x)).mean(dim=1)
        return {"logits": self.head(pooled), "pooled": pooled}


class SlowTwoHeads(TwoHeads):
    """The same model, each eager call taking a second: a request stays in flight long enough to
    send the server SIGTERM while it runs."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        time.sleep(SLOW_S)
        return super().forward(x)


STUCK_S = 60.0
STUCK_VALUE = 1234.0


class StuckTwoHeads(TwoHeads):
    """The same model, an eager call whose first value is :data:`STUCK_VALUE` taking a minute (the
    warm-up's and the load check's calls never hold it): a request still in flight, whatever the
    machine's load, when the server is told to stop twice."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if x.numel() and float(x.flatten()[0]) == STUCK_VALUE:
            mark = os.environ.get("STUCK_MARK")
            if mark:  # tells the test the call has started
                Path(mark).touch()
            time.sleep(STUCK_S)
        return super().forward(x)


def build() -> torch.nn.Module:
    return TwoHeads().eval()


def build_stuck() -> torch.nn.Module:
    return StuckTwoHeads().eval()


def build_slow() -> torch.nn.Module:
    return SlowTwoHeads().eval()


def tune(path: str | Path) -> Path:
    """Tuned with ONNX Runtime (the first that validates wins: no timing race) and saved to ``path``."""
    import aitune.torch as ait
    from aitune.torch.backend import ONNXRuntimeBackend

    model = ait.Module(
        build(), "model", strategy=ait.FirstWinsStrategy([ONNXRuntimeBackend()], performance_validation=False)
    )
    g = torch.Generator().manual_seed(1)
    ait.tune(model, [torch.randn(b, LENGTH, FEATURES, generator=g) for b in BATCH_SIZES])
    ait.save(model, path)
    return Path(path)


def build_failing() -> torch.nn.Module:
    """A factory that fails as a real one can (a missing checkpoint, no such device)."""
    raise RuntimeError("the checkpoint weights.bin is missing\n(a second line the user need not see)")
