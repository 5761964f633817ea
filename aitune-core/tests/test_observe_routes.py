"""``ait.observe_routes``: a server learns which backend answered each call, and why one ran eager."""

from __future__ import annotations

import warnings

import torch
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune.testing.backends import ToyBackend


def _tuned() -> ait.Module:
    model = ait.Module(
        SlowModule(delay_s=0).eval(),
        "mlp",
        strategy=ait.FirstWinsStrategy([ToyBackend()], performance_validation=False),
    )
    ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
    return model


def test_routes_name_the_backend_and_the_reason_for_eager(toy_backends):
    model = _tuned()
    with torch.no_grad(), ait.observe_routes() as seen, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model(torch.randn(3, 8))
        model(torch.randn(9, 8))  # batch 9: outside the tuned 2..4
    assert [(r.module, r.backend) for r in seen] == [("mlp", "toy"), ("mlp", "torch_eager")]
    assert seen[0].reason is None
    assert "outside what was tuned" in seen[1].reason and "9" in seen[1].reason


def test_nothing_is_collected_outside_the_context(toy_backends):
    model = _tuned()
    with ait.observe_routes() as seen:
        pass
    with torch.no_grad():
        model(torch.randn(3, 8))
    assert seen == []
