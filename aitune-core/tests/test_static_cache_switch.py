"""Which models ``ait.tune`` switches to a static KV cache, and when it puts them back.

Stand-ins for transformers models (a ``generation_config``, ``generate``, the class flag that
declares static-cache support) keep these tests free of transformers; tests/models runs the real ones.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import aitune.torch as ait
from aitune.engine.generation import StaticCacheSwitch, why_not_static


class FakeLM(torch.nn.Module):
    _can_compile_fullgraph = True

    def __init__(self, cache: str | None = None) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.generation_config = SimpleNamespace(cache_implementation=cache, use_cache=True)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class NoStaticLM(FakeLM):
    _can_compile_fullgraph = False


def wrapped(model: Any) -> Any:
    return ait.wrap(model, ["body"])


def test_a_function_naming_the_model_switches_it_and_an_unused_switch_is_put_back() -> None:
    model = wrapped(FakeLM())
    switch = StaticCacheSwitch.apply(lambda x: model.generate(x))
    assert model.generation_config.cache_implementation == "static"
    assert switch.settle(used=False) == []
    assert model.generation_config.cache_implementation is None


def test_a_bound_generate_and_a_pipeline_attribute_are_found() -> None:
    model = wrapped(FakeLM())
    StaticCacheSwitch.apply(model.generate).settle(used=True)
    assert model.generation_config.cache_implementation == "static"
    other = wrapped(FakeLM())
    notes = StaticCacheSwitch.apply(SimpleNamespace(lm=other)).settle(used=True)
    assert other.generation_config.cache_implementation == "static"
    assert "FakeLM.generation_config.cache_implementation" in notes[0] and "static_cache=False" in notes[0]


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (NoStaticLM(), "_can_compile_fullgraph"),
        (FakeLM(cache="dynamic"), "already names a cache ('dynamic')"),
        (torch.nn.Linear(2, 2), "no generate()"),
    ],
    ids=["undeclared", "user-chosen", "not-a-generator"],
)
def test_models_that_are_left_alone_say_why(model: Any, reason: str) -> None:
    assert reason in (why_not_static(model) or "")
    before = getattr(getattr(model, "generation_config", None), "cache_implementation", None)
    if hasattr(model, "body"):
        wrapped(model)
    StaticCacheSwitch.apply(model).settle(used=True)
    assert getattr(getattr(model, "generation_config", None), "cache_implementation", None) == before


def test_an_unwrapped_model_is_left_alone() -> None:
    model = FakeLM()
    assert StaticCacheSwitch.apply(model).models == []
    assert model.generation_config.cache_implementation is None


def test_the_recorded_calls_already_see_the_switch_unless_opted_out() -> None:
    model = wrapped(FakeLM())
    seen = []

    def pipeline(x: torch.Tensor) -> torch.Tensor:
        seen.append(model.generation_config.cache_implementation)
        return model.generate(x)

    ait.tune(pipeline, [torch.randn(1, 4)], dry_run=True)
    ait.tune(pipeline, [torch.randn(1, 4)], dry_run=True, static_cache=False)
    assert seen == ["static", None]
    assert model.generation_config.cache_implementation is None, "no recorded call used a static cache"


def test_a_failed_tune_leaves_the_config_as_it_was() -> None:
    model = wrapped(FakeLM())

    def broken(x: torch.Tensor) -> torch.Tensor:
        model.generate(x)
        raise ValueError("the pipeline failed")

    with pytest.raises(ValueError, match="pipeline failed"):
        ait.tune(broken, [torch.randn(1, 4)])
    assert model.generation_config.cache_implementation is None


class Accumulate(torch.nn.Module):
    def forward(self, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        total.add_(x.sum(0))
        return total * 2


def test_an_input_updated_in_place_is_not_a_static_cache() -> None:
    """Only a recorded KV cache keeps the switch: a module that updates a plain tensor input does not."""
    from aitune.engine import recording
    from aitune.engine.tuner import _used_a_static_cache

    module = ait.Module(Accumulate().eval(), "acc")
    total = torch.zeros(4)
    with torch.no_grad(), recording.recording(max_samples=8) as session:
        for _ in range(2):
            module(torch.randn(2, 4), total)
    assert any(g.mutated for rec in session.modules.values() for g in rec.graphs.values())
    assert not _used_a_static_cache(session)
