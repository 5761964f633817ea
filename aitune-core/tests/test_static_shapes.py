"""Static-shape builds per batch size (``MaxThroughputStrategy(static_shapes=True)``, issue 42 item 2).

A toy backend that, built for one batch size, refuses every other one (as a static engine does),
and a profiling clock with fixed figures: no test here depends on a timing race.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune import hookimpl
from aitune.backend import BuildContext
from aitune.profiling import summarize
from aitune.registry import BackendRegistry
from aitune.testing.backends import ToyBackend, register
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

pytestmark = pytest.mark.busy

CONFIG = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=20, warmup=2, window=5),
    dispatch_cost_ms=0.0,
    extend_s=0.0,
)


class StaticToy(ToyBackend):
    """A toy that builds static: built for a graph pinned to one batch size, it serves that size only."""

    name = "toy_static"
    builds_static = True
    last: StaticToy | None = None
    """The instance called last: how the clock tells the static build from the dynamic one."""

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        super().build(module, context)
        batch = context.graph.batch
        self.pinned = batch.min if batch is not None and batch.min == batch.max else None

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        if self.pinned is not None and args[0].shape[0] != self.pinned:
            raise RuntimeError(f"built for batch {self.pinned} alone, called with {args[0].shape[0]}")
        type(self).last = self
        return super().infer(*args, **kwargs)


class PlainToy(StaticToy):
    name = "toy_dynamic_only"
    builds_static = False


class Plugin:
    @hookimpl
    def aitune_register_backends(self, registry: BackendRegistry) -> None:
        register(registry, (StaticToy, PlainToy), __name__)


def clock(static_ms: dict[int, float]):
    """Eager 8 ms per row, a dynamic build 4 ms per row, a static build ``static_ms[batch]`` (windows alike)."""

    class Clock:
        @hookimpl
        def aitune_profile(self, runners, batch_size, config, device):
            out = {}
            for key, run in runners.items():
                StaticToy.last = None
                run()
                if key.startswith("torch_eager"):
                    ms = 8.0 * batch_size
                elif StaticToy.last is not None and StaticToy.last.pinned is not None:
                    ms = static_ms[batch_size]
                else:
                    ms = 4.0 * batch_size
                out[key] = summarize([ms] * 4, batch_size, 1)
            return out

    return Clock()


@pytest.fixture
def toys(toy_backends, register_plugin):
    register_plugin(Plugin(), name="static-toys")


def data(*batches: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, 8, generator=g) for b in batches]


def tuned(backend: ToyBackend, **kwargs: Any) -> tuple[ait.Module, Any]:
    strategy = ait.MaxThroughputStrategy(backends=[backend], profiling_config=CONFIG, **kwargs)
    model = ait.Module(SlowModule().eval(), "toy-model", strategy=strategy)
    report = ait.tune(model, data(1, 8, 1, 8), end_to_end=False)
    [module] = report.modules
    [graph] = module.graphs
    return model, graph


def served(model: ait.Module, batch: int) -> StaticToy:
    StaticToy.last = None
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # a call that fell back to eager would warn
        out = model(torch.randn(batch, 8))
    assert out.shape == (batch, 8)
    assert StaticToy.last is not None, "a tuned build answered"
    return StaticToy.last


def test_a_static_build_per_recorded_batch_serves_exactly_its_shape(toys, register_plugin):
    register_plugin(clock({1: 2.0, 8: 16.0}))  # twice as fast as the dynamic build at both sizes
    model, graph = tuned(StaticToy(), static_shapes=True)
    assert len(graph.candidates) == 3, "the dynamic build and one static build per recorded batch size"
    assert [(r.batch_min, r.batch_max, r.backend, r.static) for r in graph.routes] == [
        (1, 1, "toy_static", True),
        (8, 8, "toy_static", True),
        (1, 8, "toy_static", False),
    ]
    assert [(c.variant, c.status) for c in graph.candidates] == [
        (None, "selected"),
        ("static batch 1", "selected"),
        ("static batch 8", "selected"),
    ]
    assert graph.candidates[2].reason.startswith("2.00x [2.00-2.00] against the dynamic build at batch 8; adds ")
    assert "MB to the artifact and" in graph.candidates[2].reason and "s to ait.load" in graph.candidates[2].reason
    assert graph.decision.startswith(
        "toy_static (static batch 1) (batch 1..1), toy_static (static batch 8) (batch 8..8)"
    )
    assert any(n.startswith("static shapes: toy_static for batch 1") for n in graph.notes)
    assert [b.pinned for _, b in model.tuned_graphs] == [1, 8, None]
    assert [p.batch_size for p in graph.eager_profiles] == [1, 8], "one eager figure per batch size, as before"
    assert graph.candidates[2].speedup == pytest.approx(4.0), "against the eager of its own session"
    assert served(model, 8).pinned == 8
    assert served(model, 1).pinned == 1


def test_a_call_of_another_batch_size_goes_to_the_dynamic_winner(toys, register_plugin):
    register_plugin(clock({1: 2.0, 8: 16.0}))
    model, _ = tuned(StaticToy(), static_shapes=True)
    dynamic = model.tuned_graphs[-1][1]
    before = dynamic.calls
    assert served(model, 4) is dynamic, "batch 4 was never recorded: no static build serves it"
    assert dynamic.calls == before + 1


def test_a_static_build_that_does_not_pay_is_not_kept(toys, register_plugin):
    register_plugin(clock({1: 3.96, 8: 31.0}))  # 1% and 3% faster: below a 5% bar
    model, graph = tuned(StaticToy(), static_shapes=True, min_static_gain=0.05)
    assert len(graph.candidates) == 3, "both were built and timed"
    assert graph.routes == [] and graph.decision == "toy_static"
    rejected = [c for c in graph.candidates if c.variant]
    assert [c.status for c in rejected] == ["rejected", "rejected"]
    assert "kept only from 1.05x" in rejected[0].reason
    assert [b.pinned for _, b in model.tuned_graphs] == [None]


def test_static_routes_survive_save_and_load(toys, register_plugin, tmp_path):
    register_plugin(clock({1: 2.0, 8: 16.0}))
    model, _ = tuned(StaticToy(), static_shapes=True)
    saved = ait.save(model, tmp_path / "static.ait")
    loaded = ait.load(ait.Module(SlowModule().eval(), "toy-model"), saved)
    graphs = [(g.batch.min, g.batch.max, b.pinned) for g, b in loaded.tuned_graphs]
    assert graphs == [(1, 1, 1), (8, 8, 8), (1, 8, None)]
    assert served(loaded, 8).pinned == 8
    assert served(loaded, 5).pinned is None


def test_static_shapes_off_by_default_builds_none(toys, register_plugin):
    register_plugin(clock({1: 2.0, 8: 16.0}))
    _, graph = tuned(StaticToy())
    assert [c.variant for c in graph.candidates] == [None]
    assert graph.decision == "toy_static" and not any("static" in n for n in graph.notes)


def test_a_backend_that_cannot_build_static_gets_no_static_build(toys, register_plugin):
    register_plugin(clock({1: 2.0, 8: 16.0}))
    _, graph = tuned(PlainToy(), static_shapes=True)
    assert len(graph.candidates) == 1 and graph.decision == "toy_dynamic_only"


def test_min_static_gain_must_not_be_negative():
    with pytest.raises(ValueError, match="min_static_gain must be >= 0"):
        ait.MaxThroughputStrategy(static_shapes=True, min_static_gain=-0.1)


def test_a_graph_whose_other_axes_vary_gets_no_static_build(toys, register_plugin):
    register_plugin(clock({1: 2.0, 8: 16.0}))
    strategy = ait.MaxThroughputStrategy(backends=[StaticToy()], profiling_config=CONFIG, static_shapes=True)
    model = ait.Module(SlowModule().eval(), "toy-model", strategy=strategy)
    g = torch.Generator().manual_seed(0)
    report = ait.tune(model, [torch.randn(1, 3, 8, generator=g), torch.randn(8, 5, 8, generator=g)], end_to_end=False)
    [graph] = report.modules[0].graphs
    assert len(graph.candidates) == 1 and graph.routes == []
    assert any("no static-shape builds: axes other than the batch vary (d0 3..5)" in n for n in graph.notes)


def test_a_graph_of_one_batch_size_gets_no_static_build(toys, register_plugin):
    register_plugin(clock({1: 2.0, 8: 16.0}))
    strategy = ait.MaxThroughputStrategy(backends=[StaticToy()], profiling_config=CONFIG, static_shapes=True)
    model = ait.Module(SlowModule().eval(), "toy-model", strategy=strategy)
    report = ait.tune(model, data(8, 8), end_to_end=False)
    [graph] = report.modules[0].graphs
    assert len(graph.candidates) == 1 and graph.routes == []
    assert any("one batch size, which its builds are made for already" in n for n in graph.notes)


class Doubled(torch.nn.Module):
    """Any shape runs eager: a call of a size never tuned still gets its answer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_a_call_outside_every_route_is_told_only_what_the_routes_holding_its_batch_lack(toys, register_plugin):
    """Batch 1 with a row length never tuned: the batch-8 static route, which batch 1 is outside of, is
    not the call's route, so the warning never advises widening its batch range (SD3's mixed reasons)."""
    register_plugin(clock({1: 2.0, 8: 16.0}))
    strategy = ait.MaxThroughputStrategy(backends=[StaticToy()], profiling_config=CONFIG, static_shapes=True)
    model = ait.Module(Doubled().eval(), "doubled", strategy=strategy)
    ait.tune(model, data(1, 8, 1, 8), end_to_end=False)
    assert [b.pinned for _, b in model.tuned_graphs] == [1, 8, None]
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="outside what was tuned") as seen:
        out = model(torch.ones(1, 9))
    assert torch.equal(out, torch.full((1, 9), 2.0))
    [message] = [str(w.message) for w in seen if "outside what was tuned" in str(w.message)]
    assert "axis 1" in message, message
    assert "8..8" not in message and "axis 0" not in message, message
