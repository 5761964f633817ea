"""A third party's strategy written on :mod:`aitune.torch.strategies` (issue 54 item 7): one ``pick``
method, and the report, identity and repr come from the base and the config.

The figures come from a fixed profiling clock (eager 8 ms, the exact toy 4 ms, the approximate toy
2 ms per call), so no decision here depends on a timing race.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import torch
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune import hookimpl
from aitune.profiling import summarize
from aitune.registry import BackendRegistry
from aitune.testing.backends import ToyBackend, ToyConfig, register
from aitune.torch.strategies import CandidateFigures, Choice, Strategy, StrategyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=4, warmup=1, window=2),
    dispatch_cost_ms=0.0,
    extend_s=0.0,
)


# -- what a newcomer writes -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class AccurateConfig(StrategyConfig):
    max_rel_error: float = 1e-4


class FastestAccurate(Strategy[AccurateConfig]):
    """The fastest candidate that beats eager with an error below ``max_rel_error``."""

    def pick(self, candidates: Sequence[CandidateFigures]) -> Choice:
        bound = self.config.max_rel_error
        fine = [c for c in candidates if c.max_rel_error <= bound and c.beats_eager]
        if not fine:
            return Choice(None, f"no candidate beats eager within {bound:g} error")
        best = max(fine, key=lambda c: c.speedup or 0.0)
        return Choice(best, f"{best.backend}: the fastest within {bound:g} error ({best.speedup:.2f}x eager)")


# -- the test's own doubles -------------------------------------------------------------------


class ApproxToy(ToyBackend):
    """Correct within float32's tolerance, but off by 5e-4 of the output's scale."""

    name = "toy_approx"

    def transform(self, output: Any, args: tuple[Any, ...]) -> Any:
        return output + 5e-4 * output.abs().max()


class Plugin:
    @hookimpl
    def aitune_register_backends(self, registry: BackendRegistry) -> None:
        register(registry, (ApproxToy,), __name__)


MS = {"torch_eager": 8.0, "toy": 4.0, "toy_approx": 2.0}


class Clock:
    """Fixed figures per call (:data:`MS`): eager 8 ms, ``toy`` 4 ms, ``toy_approx`` 2 ms."""

    @hookimpl
    def aitune_profile(self, runners, batch_size, config, device):
        out = {}
        for key, run in runners.items():
            run()
            out[key] = summarize([MS[key.split("#")[0]]] * 4, batch_size, 1)
        return out


@pytest.fixture
def toys(toy_backends, register_plugin):
    register_plugin(Plugin(), name="approx-toy")
    register_plugin(Clock(), name="clock")


def tune(strategy: ait.TuneStrategy) -> Any:
    module = SlowModule(delay_s=0.0).eval()
    model = ait.Module(module, "toy-model", strategy=strategy)
    g = torch.Generator().manual_seed(0)
    report = ait.tune(model, [torch.randn(2, 8, generator=g) for _ in range(2)], end_to_end=False)
    [graph] = report.modules[0].graphs
    return report.modules[0], graph


def statuses(graph: Any) -> dict[str, str]:
    return {c.backend: c.status.value for c in graph.candidates}


def test_the_pick_is_recorded_as_selected_with_its_reason(toys):
    strategy = FastestAccurate(backends=[ToyBackend(), ApproxToy()], profiling_config=QUICK, max_rel_error=1e-4)
    module, graph = tune(strategy)
    assert statuses(graph) == {"toy": "selected", "toy_approx": "rejected"}, "the faster one is too inaccurate"
    assert graph.decision == "toy"
    assert graph.reason == "toy: the fastest within 0.0001 error (2.00x eager)"
    assert graph.selected_batch_size == 2
    assert module.status.value == "tuned"
    assert graph.candidates[0].speedup == pytest.approx(2.0), "the figures the report shows are written"


def test_a_looser_bound_picks_the_faster_candidate(toys):
    strategy = FastestAccurate(backends=[ToyBackend(), ApproxToy()], profiling_config=QUICK, max_rel_error=1e-2)
    _, graph = tune(strategy)
    assert statuses(graph) == {"toy": "rejected", "toy_approx": "selected"}
    assert graph.reason == "toy_approx: the fastest within 0.01 error (4.00x eager)"


def test_choosing_eager_leaves_no_candidate_pending(toys):
    strategy = FastestAccurate(backends=[ApproxToy()], profiling_config=QUICK, max_rel_error=0.0)
    module, graph = tune(strategy)
    assert statuses(graph) == {"toy_approx": "rejected"}
    assert graph.decision == "torch_eager"
    assert graph.reason == "no candidate beats eager within 0 error"
    assert module.status.value == "eager"


def test_no_correct_candidate_keeps_eager_without_asking_pick(toys):
    class Never(Strategy[StrategyConfig]):
        def pick(self, candidates: Sequence[CandidateFigures]) -> Choice:
            raise AssertionError("pick is asked only with correct candidates")

    _, graph = tune(Never(backends=[ToyBackend(ToyConfig(fail_build=True))], profiling_config=QUICK))
    assert statuses(graph) == {"toy": "failed"}
    assert graph.decision == "torch_eager"
    assert graph.reason.startswith("no backend built and passed validation; running eager. toy: ")


def test_a_pick_that_returns_something_else_says_what_to_return(toys):
    class Sloppy(Strategy[StrategyConfig]):
        def pick(self, candidates: Sequence[CandidateFigures]) -> Any:
            return candidates[0]

    with pytest.raises(TypeError, match=r"Sloppy.pick must return Choice\(candidate or None, reason\)"):
        model = ait.Module(SlowModule(delay_s=0.0).eval(), "toy-model", strategy=Sloppy(backends=[ToyBackend()]))
        ait.tune(model, [torch.randn(2, 8)], end_to_end=False, fail_fast=True)


def test_repr_and_identity_follow_the_config():
    a = FastestAccurate(backends=[ToyBackend()], max_rel_error=1e-3)
    assert repr(a) == "FastestAccurate(backends=['toy'], max_rel_error=0.001)"
    assert repr(FastestAccurate(backends=[ToyBackend()])) == "FastestAccurate(backends=['toy'])"
    assert isinstance(a.config, AccurateConfig) and a.config.max_rel_error == 1e-3
    same = FastestAccurate(backends=[ToyBackend()], max_rel_error=1e-3)
    other = FastestAccurate(backends=[ToyBackend()], max_rel_error=1e-2)
    assert a.identity() == same.identity() != other.identity()
    assert a.identity_data()["config"]["max_rel_error"] == 1e-3
    assert "attributes" not in a.identity_data(), "every parameter is in the config, none a bare attribute"


def test_the_report_names_the_strategy_by_its_identity(toys):
    strategy = FastestAccurate(backends=[ToyBackend()], profiling_config=QUICK, max_rel_error=1e-3)
    module, _ = tune(strategy)
    assert module.strategy == strategy.identity()


def test_a_config_type_argument_that_is_no_strategy_config_is_refused():
    with pytest.raises(TypeError, match="takes a frozen attrs StrategyConfig subclass"):

        class Wrong(Strategy[int]):  # type: ignore[type-var]
            pass
