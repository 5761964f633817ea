"""A small JIT run shared by the scripts here: toy backends, a build counter, one report line of JSON.

The toy backend stands in for a compiler (the JIT's own logic is what the tests check); its
builds are counted through the ``aitune_build`` hook, so "no build" is observed, not timed.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import attrs
import torch

from aitune import hookimpl


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.proj(x)))


class BuildCounter:
    builds = 0

    @hookimpl(wrapper=True)
    def aitune_build(self, backend: Any, module: Any, context: Any) -> Any:
        BuildCounter.builds += 1
        return (yield)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    import aitune.testing.backends as toy
    from aitune.engine.recording import bypass
    from aitune.plugins import get_manager
    from aitune.torch import FirstWinsStrategy, jit

    manager = get_manager()
    manager.register(toy, name="aitune.testing.backends", distribution="aitune-core")
    manager.register(BuildCounter(), name="build-counter")
    routed = []
    infer = toy.ToyBackend.infer
    toy.ToyBackend.infer = lambda self, *a, **k: routed.append(1) or infer(self, *a, **k)  # type: ignore[method-assign]

    jit.config.strategy = FirstWinsStrategy([toy.ToyBackend()], performance_validation=False)
    jit.config.min_parameters = 0
    jit.config.min_samples = 2

    torch.manual_seed(0)
    model = Encoder().eval()
    matches = True
    with torch.no_grad():
        for batch in (2, 3, 2, 3, 2):
            x = torch.randn(batch, 16)
            y = model(x)
            with bypass():  # the module's own forward, for comparison
                matches = matches and torch.allclose(y, model(x), rtol=1e-3, atol=1e-5)  # validation's float32 bound
    report = {
        "enabled": jit.enabled(),
        "decisions": [attrs.asdict(d) for d in jit.decisions()],
        "builds": BuildCounter.builds,
        "routed": len(routed),
        "matches": matches,
    }
    print(json.dumps(report))
