"""Exits while the background tuner is still building: the process must end at once and cleanly.

The toy backend's build sleeps far longer than the script runs; the last line of JSON says where
the module stood when the script returned (still tuning, its calls eager and correct).
"""

from __future__ import annotations

import json
import logging
import time

import torch

import aitune.testing.backends as toy
import aitune.torch.jit.enable  # noqa: F401
from aitune.plugins import get_manager
from aitune.torch import FirstWinsStrategy, jit


class SlowBuild(toy.ToyBackend):
    name = "toy"

    def build(self, module: torch.nn.Module, context: object) -> None:
        time.sleep(60)  # a compiler that takes a minute
        super().build(module, context)


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))


logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
get_manager().register(toy, name="aitune.testing.backends", distribution="aitune-core")
jit.config.strategy = FirstWinsStrategy([SlowBuild()], performance_validation=False)
jit.config.min_parameters = 0
jit.config.min_samples = 2
jit.config.remember = False
model = Encoder().eval()
correct = True
with torch.no_grad():
    for _ in range(4):
        x = torch.randn(3, 8 * 2)
        expected = torch.relu(torch.nn.functional.linear(x, model.proj.weight, model.proj.bias))  # no module call
        correct &= bool(torch.allclose(model(x), expected))
print(json.dumps({"status": jit.status(), "correct": correct, "mode": jit.config.mode}))
