"""Profiling: figures, stop strategies and alternating windows."""

from __future__ import annotations

import time

import attrs
import pytest
import torch

from aitune.engine.figures import compare
from aitune.profiling import (
    CvMeasuringStopStrategy,
    ModelExecutionTimeMeasuringStrategy,
    NumStepsMeasuringStopStrategy,
    ProfilingConfig,
    profile_runners,
    summarize,
)
from aitune.profiling.stop import (
    AllSamplesProfilingStopStrategy,
    ThroughputSaturatedProfilingStopStrategy,
)
from aitune.report import ProfileResult


def result(batch, ms, windows=None):
    return ProfileResult(batch, 10, ms, ms, ms, ms, 0.0, ms, batch / ms * 1000, windows or [ms])


def test_summary_figures():
    r = summarize([1.0, 2.0, 3.0, 4.0, 100.0], batch_size=4, window=2)
    assert (r.p50_ms, r.min_ms, r.steps) == (3.0, 1.0, 5)
    assert r.mean_ms == pytest.approx(22.0)
    assert r.p99_ms > r.p90_ms > r.p50_ms
    assert r.throughput == pytest.approx(4 / 0.003), "throughput comes from the median, like every decision"
    assert r.window_p50_ms == [1.5, 3.5, 100.0]


def test_outliers_do_not_reorder_throughput():
    # the demo's case: a backend with a few 4 ms interruptions and a lower median
    interrupted = summarize([0.067] * 57 + [4.0] * 3, batch_size=1, window=10)
    steady = summarize([0.113] * 60, batch_size=1, window=10)
    assert interrupted.mean_ms > steady.mean_ms, "by the mean it would look slower"
    assert interrupted.throughput > steady.throughput, "by the figure decisions use it is faster"


def test_runners_alternate_and_get_their_steps():
    order = []
    runners = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    stop = NumStepsMeasuringStopStrategy(num_steps=6, warmup=1, window=3)
    config = ProfilingConfig(measurement_stop_strategy=stop, extend_s=0.0)  # no extension: exactly the steps asked
    results = profile_runners(runners, 1, config, torch.device("cpu"))
    assert results["a"].steps == results["b"].steps == 6
    timed = order[2:]  # after one warm-up call each
    assert timed == ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3, "windows alternate in rotated order"


class ScriptedClock:
    """Says how long a runner's call took: the figure of the name it returns (no timing race)."""

    def __init__(self, ms):
        self.ms = ms

    def measure(self, fn, device):
        return self.ms[fn()]


def test_a_runner_clearly_behind_stops_being_timed_and_keeps_a_paired_figure():
    ms = {"eager": 10.0, "fast": 5.0, "close": 6.0, "slow": 9.0}
    runners = {name: (lambda name=name: name) for name in ms}
    stop = NumStepsMeasuringStopStrategy(num_steps=60, warmup=0, window=10)
    config = ProfilingConfig(measurement_stop_strategy=stop, measuring_strategy=ScriptedClock(ms), extend_s=0.0)
    results = profile_runners(runners, 1, config, torch.device("cpu"))
    steps = {name: r.steps for name, r in results.items()}
    # 9 ms is more than 1.25 x fast's slowest window (5 ms) after three windows: no more of it is timed;
    # eager, the first runner, is slower still but every candidate is paired with it, so it runs to the end
    assert steps == {"eager": 60, "fast": 60, "close": 60, "slow": 30}
    slow = attrs.evolve(results["slow"], baseline_p50_ms=10.0, baseline_window_p50_ms=results["eager"].window_p50_ms)
    assert compare(slow).speedup == pytest.approx(10.0 / 9.0), "its figure is the windows it has, paired"

    everyone = attrs.evolve(config, behind=None)
    assert {r.steps for r in profile_runners(runners, 1, everyone, torch.device("cpu")).values()} == {60}
    with pytest.raises(ValueError):
        ProfilingConfig(behind=1.0)


def test_a_slow_call_is_timed_for_three_windows_and_the_time_budget_not_sixty_steps():
    """The default profiling stops a runner once it has three windows and 1.5 s of calls (a BERT at
    batch 8 on two cores: 60-80 ms a call), never before three windows, and never at batch 1's
    milliseconds; the baseline (eager, first) times a window in every round another runner does,
    so every figure stays paired with it."""
    ms = {"eager": 80.0, "mid": 60.0, "fast": 8.0}
    runners = {name: (lambda name=name: name) for name in ms}
    config = ProfilingConfig(measuring_strategy=ScriptedClock(ms), extend_s=0.0)
    assert config.measurement_stop_strategy == NumStepsMeasuringStopStrategy(max_timed_s=1.5)
    steps = {name: r.steps for name, r in profile_runners(runners, 8, config, torch.device("cpu")).items()}
    assert steps == {"eager": 60, "mid": 30, "fast": 60}
    slow_only = {name: runners[name] for name in ("eager", "mid")}
    steps = {name: r.steps for name, r in profile_runners(slow_only, 8, config, torch.device("cpu")).items()}
    assert steps == {"eager": 30, "mid": 30}
    exact = attrs.evolve(config, measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=50))
    assert {r.steps for r in profile_runners(slow_only, 8, exact, torch.device("cpu")).values()} == {50}
    budget = NumStepsMeasuringStopStrategy(max_timed_s=0.1)
    assert not budget.done([500.0] * 29), "three windows first, however long the calls"
    assert budget.done([500.0] * 30)


def test_cpu_timer_measures_a_sleep():
    ms = ModelExecutionTimeMeasuringStrategy().measure(lambda: time.sleep(0.005), torch.device("cpu"))
    assert ms >= 5.0


def test_cv_stop_waits_for_stable_windows():
    stop = CvMeasuringStopStrategy(max_cv=0.05, min_steps=6, max_steps=100, window=2, stable_windows=3)
    assert not stop.done([1.0] * 5)
    assert stop.done([1.0] * 6)
    assert not stop.done([1.0, 1.0, 1.0, 1.0, 5.0, 5.0])
    assert stop.done([9.0] * 100), "max_steps bounds a noisy machine"


def test_profiling_stop_strategies():
    assert not AllSamplesProfilingStopStrategy().should_stop([result(b, 1.0) for b in (1, 2, 4)])
    saturated = ThroughputSaturatedProfilingStopStrategy(min_gain=0.05, patience=2)
    growing = [result(1, 1.0), result(2, 1.0), result(4, 1.0)]
    flat = [result(1, 1.0), result(2, 2.0), result(4, 4.0)]
    assert not saturated.should_stop(growing)
    assert saturated.should_stop(flat)


def test_comparison_uses_window_spread():
    eager = result(1, 2.0, [2.0, 2.0, 2.0, 2.0])
    clear = compare(result(1, 1.0, [1.0, 1.0, 1.0, 1.0]), eager)
    noisy = compare(result(1, 1.0, [0.5, 0.6, 2.5, 3.0]), eager)
    assert clear.speedup == noisy.speedup == 2.0
    assert clear.low_speedup == 2.0
    assert noisy.low_speedup < 1.0, "a candidate that loses in some windows is not clearly faster"
    unlucky_eager = compare(result(1, 1.0, [1.0] * 6), result(1, 3.4, [3.1, 3.3, 3.4, 3.5, 9.0, 12.0]))
    assert unlucky_eager.low_speedup > 2.5, "windows where eager was slow do not hide a real win"


def test_the_interval_always_contains_the_figure_shown():
    eager = result(1, 2.0, [1.0, 1.1, 1.2, 1.3])
    cmp = compare(result(1, 1.0, [1.0, 1.0, 1.0, 1.0]), eager)
    assert cmp.low_speedup <= cmp.speedup <= cmp.high_speedup
    assert 1.0 < cmp.low_speedup < 1.3 and cmp.high_speedup == 2.0
    assert cmp.describe(max_noise=0.5).startswith("2.00x [1.")
    # wider than ±10%: no point figure, only the bound the whole interval clears
    assert cmp.describe() == f"at least {cmp.low_speedup:.2f}x (noise ±23%)"


def test_a_result_is_compared_with_the_eager_of_its_own_session():
    import attrs

    mine = attrs.evolve(result(1, 1.0, [1.0, 1.0]), baseline_p50_ms=3.0, baseline_window_p50_ms=[3.0, 3.0])
    assert compare(mine).speedup == pytest.approx(3.0)
    with pytest.raises(ValueError, match="needs a baseline"):
        compare(result(1, 1.0))
