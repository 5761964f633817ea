"""Exits while the background tuner runs native code (a candidate's calls, timed): the process must
end cleanly, never abort ("terminate called without an active exception").

A daemon thread that is inside a native call when the interpreter finalizes is stopped when it
takes the GIL back, unwinding through C++ frames that may not unwind: the abort. The script lets
the tuner get into validation and profiling (each call a few matrix products), then returns.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

import aitune.testing.backends as toy
import aitune.torch.jit.enable  # noqa: F401
from aitune.engine.jit.sharing import measuring_strategy
from aitune.plugins import get_manager
from aitune.torch import FirstWinsStrategy, jit
from aitune.torch.task.profiling import ProfilingConfig


def native_work() -> None:
    a = torch.randn(192, 192)
    for _ in range(8):
        a = torch.tanh(a @ a)


class NativeCalls(toy.ToyBackend):
    name = "toy"

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        native_work()
        return super().infer(*args, **kwargs)


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native_work()
        return torch.relu(self.proj(x))


get_manager().register(toy, name="aitune.testing.backends", distribution="aitune-core")
profiling = ProfilingConfig(measuring_strategy=measuring_strategy())
jit.config.strategy = FirstWinsStrategy([NativeCalls()], profiling, performance_validation=True)
jit.config.min_parameters = 0
jit.config.min_samples = 2
jit.config.remember = False
jit.config.max_tuning_share = 1.0  # no pause between timed calls: the tuner is in native code most of the time
model = Encoder().eval()
with torch.no_grad():
    for _ in range(3):
        model(torch.randn(3, 16))
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)  # the tuner is timing calls now
print(json.dumps({"status": jit.status(), "mode": jit.config.mode}))
