"""Exits while the background tuner runs native code (a candidate's calls, timed): the process must
end cleanly, never abort ("terminate called without an active exception").

A daemon thread that is inside a native call when the interpreter finalizes is stopped when it
takes the GIL back, unwinding through C++ frames that may not unwind: the abort. The script waits
until the tuner has timed some calls of the candidate (each call a few matrix products), then
returns while profiling goes on: profiling is long (a thousand steps a runner, no early stop for a
runner behind), so the script cannot return after the tuner finished, however fast the machine.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import torch

import aitune.testing.backends as toy
import aitune.torch.jit.enable  # noqa: F401
from aitune.engine.jit.sharing import measuring_strategy
from aitune.plugins import get_manager
from aitune.torch import FirstWinsStrategy, jit
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

TIMED_CALLS = 20
"""Calls of the candidate to wait for: validation's few, then profiling's."""


def native_work() -> None:
    a = torch.randn(192, 192)
    for _ in range(8):
        a = torch.tanh(a @ a)


class NativeCalls(toy.ToyBackend):
    name = "toy"
    calls = 0
    timing = threading.Event()

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        native_work()
        NativeCalls.calls += 1
        if NativeCalls.calls >= TIMED_CALLS:
            NativeCalls.timing.set()
        return super().infer(*args, **kwargs)


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native_work()
        return torch.relu(self.proj(x))


get_manager().register(toy, name="aitune.testing.backends", distribution="aitune-core")
profiling = ProfilingConfig(
    measuring_strategy=measuring_strategy(),
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=1000),
    behind=None,
    extend_s=0.0,
)
jit.config.strategy = FirstWinsStrategy([NativeCalls()], profiling, performance_validation=True)
jit.config.min_parameters = 0
jit.config.min_samples = 2
jit.config.remember = False
jit.config.max_tuning_share = 1.0  # no pause between timed calls: the tuner is in native code most of the time
model = Encoder().eval()
with torch.no_grad():
    for _ in range(3):
        model(torch.randn(3, 16))
NativeCalls.timing.wait(timeout=float(sys.argv[1]) if len(sys.argv) > 1 else 60.0)  # the tuner is timing calls now
print(json.dumps({"status": jit.status(), "mode": jit.config.mode}))
