"""Figures a user can repeat: profiling that outvotes a burst of noise or says "not measured",
and the end-to-end figure of the whole callable, led with in the report.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import torch
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune import hookimpl
from aitune.engine import end_to_end, inspection
from aitune.engine.figures import compare
from aitune.errors import InputError
from aitune.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig, profile_runners, summarize
from aitune.render.markdown import render_markdown
from aitune.testing.backends import ToyBackend, ToyConfig

QUICK = ProfilingConfig(measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=20, warmup=2, window=5))


class ScriptedClock:
    """A measuring strategy that returns each runner's next scripted latency instead of timing it."""

    def __init__(self, scripts: dict[str, Any]) -> None:
        self.scripts = {name: iter(script) for name, script in scripts.items()}

    def measure(self, fn: Any, device: torch.device) -> float:
        return next(self.scripts[fn.__name__])


def runner(name: str) -> Any:
    def run() -> None:
        return None

    run.__name__ = name
    return run


def noisy(base: float, until: int | None, seed: int) -> Any:
    """``base`` ms, up to 6x slower at random for the first ``until`` calls (None: always)."""
    rng = random.Random(seed)
    for i in itertools.count():
        busy = until is None or i < until
        yield base * (1 + 5 * rng.random()) if busy and rng.random() < 0.5 else base


def profile(scripts: dict[str, Any], extend_s: float) -> dict[str, Any]:
    clock = ScriptedClock(scripts)
    config = ProfilingConfig(
        measuring_strategy=clock,  # type: ignore[arg-type]
        measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=20, warmup=0, window=5),
        extend_s=extend_s,
    )
    return profile_runners({name: runner(name) for name in scripts}, 1, config, torch.device("cpu"))


def test_a_burst_of_noise_is_outvoted_by_more_windows() -> None:
    results = profile({"eager": noisy(2.0, until=20, seed=1), "fast": noisy(1.0, until=20, seed=2)}, extend_s=5.0)
    cmp = compare(results["fast"], results["eager"])
    assert results["fast"].steps > 20, "profiling went on after the burst"
    assert cmp.measured() and 1.9 <= cmp.speedup <= 2.1, cmp.describe()


def test_steady_noise_runs_out_of_budget_and_is_not_measured() -> None:
    results = profile({"eager": noisy(2.0, None, seed=3), "fast": noisy(1.0, None, seed=4)}, extend_s=0.2)
    cmp = compare(results["fast"], results["eager"])
    assert not cmp.measured()
    assert cmp.describe().startswith("not measured: noise ±")


def noisy_clock(seed: int) -> Any:
    """A profiling plugin whose windows swing up to 4x at random: a busy machine."""
    rng = random.Random(seed)

    class Clock:
        @hookimpl
        def aitune_profile(self, runners, batch_size, config, device):
            out = {}
            for name in runners:
                base = 2.0 if name.startswith("torch_eager") else 1.0
                windows = [base * (1 + 3 * rng.random()) for _ in range(8)]
                out[name] = summarize(windows, batch_size, 1)
            return out

    return Clock()


def test_no_interval_is_shown_wider_than_the_stated_width_unless_marked(toy_backends, register_plugin) -> None:
    register_plugin(noisy_clock(5))
    model = ait.Module(SlowModule(), "m", strategy=ait.MaxThroughputStrategy([ToyBackend(ToyConfig(speed=0.5))], QUICK))
    report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], end_to_end=False)
    shown = [c for g in report.modules[0].graphs for c in g.candidates if c.speedup is not None]
    assert shown
    for c in shown:
        width = (c.speedup_high - c.speedup_low) / (2 * c.speedup)
        assert c.measured == (width <= QUICK.max_noise)
        if not c.measured:
            assert c.speedup_text().startswith("not measured: noise ±")
            assert f"{c.speedup:.2f}x" not in report.modules[0].summary
    assert any(c.measured is False for c in shown), "this clock is too noisy for ±10%"
    assert "not measured" in render_markdown(report)


class Pipeline(torch.nn.Module):
    """Two equal stages, one wrapped: tuning it can at best halve the time."""

    def __init__(self) -> None:
        super().__init__()
        strategy = ait.MaxThroughputStrategy([ToyBackend(ToyConfig(speed=0.1))], QUICK)
        self.first = ait.Module(SlowModule(delay_s=0.004), "first", strategy=strategy)
        self.second = SlowModule(delay_s=0.004)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def data() -> list[torch.Tensor]:
    return [torch.randn(2, 8), torch.randn(4, 8)]


class VirtualTime:
    """A clock that moves only when a :class:`Stage` runs: timings without a timing race."""

    def __init__(self) -> None:
        self.now = 0.0

    def __deepcopy__(self, memo: dict) -> VirtualTime:
        return self  # a backend's copy of a stage moves the same clock

    def perf_counter(self) -> float:
        return self.now

    def measure(self, fn: Any, device: torch.device) -> float:  # a profiling measuring strategy, in ms
        start = self.now
        fn()
        return (self.now - start) * 1e3


class Stage(SlowModule):
    """A :class:`SlowModule` whose ``delay_s`` advances a :class:`VirtualTime` instead of sleeping
    (toy backends scale ``delay_s`` as they do the sleep)."""

    def __init__(self, clock: VirtualTime, delay_s: float) -> None:
        super().__init__(delay_s=delay_s)
        self.clock = clock

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        self.clock.now += self.delay_s
        return torch.tanh(self.fc(x))


def test_a_partial_wrap_reports_the_whole_and_each_share(toy_backends, monkeypatch) -> None:
    clock = VirtualTime()
    monkeypatch.setattr(end_to_end, "time", clock)  # the whole call, timed on the same clock
    config = ProfilingConfig(measuring_strategy=clock, measurement_stop_strategy=QUICK.measurement_stop_strategy)
    strategy = ait.MaxThroughputStrategy([ToyBackend(ToyConfig(speed=0.1))], config)
    pipe = torch.nn.Sequential(ait.Module(Stage(clock, 0.004), "first", strategy=strategy), Stage(clock, 0.004))
    report = ait.tune(pipe.eval(), data())
    module_speedup = report.modules[0].graphs[0].candidates[0].speedup
    assert module_speedup is not None and module_speedup > 3
    e2e = report.end_to_end
    assert e2e is not None and e2e.speedup is not None, e2e
    assert 0.3 <= e2e.shares["first"] <= 0.7
    bound = 1 / ((1 - e2e.shares["first"]) + e2e.shares["first"] / module_speedup)
    assert 1.2 <= e2e.speedup <= bound * 1.15, "the whole gains at most what Amdahl allows, far less than the module"
    assert render_markdown(report).splitlines()[4].startswith("| end to end |"), "the report leads with it"


def test_end_to_end_is_optional_and_says_why_it_is_missing(toy_backends) -> None:
    assert ait.tune(Pipeline().eval(), data(), end_to_end=False).end_to_end is None
    report = ait.tune(Pipeline().eval(), iter(data()), end_to_end=1.0)
    assert report.end_to_end is not None  # an iterator's first items are kept as they pass
    with pytest.raises(InputError, match="end_to_end"):
        ait.tune(Pipeline().eval(), data(), end_to_end=-1)


def test_a_call_that_raises_while_timed_leaves_a_reason_not_a_failure() -> None:
    def boom(item: Any) -> None:
        raise RuntimeError("no second pass")

    result = end_to_end.measure(boom, [1], [], budget_s=0.1)
    assert result.speedup is None and "no second pass" in (result.reason or "")
    assert result.describe().startswith("not measured")


@pytest.mark.busy
def test_on_a_busy_machine_the_figure_holds_or_says_it_was_not_measured(toy_backends) -> None:
    """One core kept busy by another process, as on a shared machine: the reported end-to-end
    interval and one measured again afterwards overlap, or the report says "not measured"."""
    pipe = Pipeline().eval()
    report = ait.tune(pipe, data())
    again = end_to_end.measure(lambda x: pipe(x), data(), [], budget_s=5.0)
    first = report.end_to_end
    assert first is not None and first.speedup is not None
    if first.measured and again.measured:
        assert first.speedup_low <= again.speedup_high and again.speedup_low <= first.speedup_high, (
            first.describe(),
            again.describe(),
        )
    else:
        assert "not measured" in first.describe() or "not measured" in again.describe()


def test_inspect_predicts_the_bound_the_end_to_end_figure_respects(toy_backends, monkeypatch) -> None:
    clock = VirtualTime()
    monkeypatch.setattr(inspection, "time", clock)  # ait.inspect and the end-to-end figure on one clock
    monkeypatch.setattr(end_to_end, "time", clock)

    def plain() -> torch.nn.Module:
        return torch.nn.Sequential(Stage(clock, 0.004), Stage(clock, 0.004)).eval()

    found = ait.inspect(plain(), data())
    bound = found.max_speedup(["0"])
    assert 1.6 <= bound <= 2.5, "one of two equal stages: at most about 2x, whatever its own speed-up"
    assert found.max_speedup(["0"], module_speedup=1.0) == pytest.approx(1.0)
    config = ProfilingConfig(measuring_strategy=clock, measurement_stop_strategy=QUICK.measurement_stop_strategy)
    pipe = plain()
    pipe[0] = ait.Module(
        pipe[0], "first", strategy=ait.MaxThroughputStrategy([ToyBackend(ToyConfig(speed=0.1))], config)
    )
    report = ait.tune(pipe, data())
    assert report.end_to_end is not None and report.end_to_end.speedup is not None
    assert 1.2 <= report.end_to_end.speedup <= bound * 1.15
