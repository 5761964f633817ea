"""Profiling: how candidates are timed, for how long, and over which batch sizes.

Runners are measured in alternating windows (eager, candidate A, candidate B, eager, ...), each
window in a rotated order, so a machine that slows down mid-measurement slows every contender
alike. Figures are kept per window, so a decision can tell a real gap from noise.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch

from ..report import MAX_NOISE, ProfileResult
from .stop import (
    AllSamplesProfilingStopStrategy,
    ProfilingStopStrategy,
    ThroughputSaturatedProfilingStopStrategy,
)

__all__ = [
    "AllSamplesProfilingStopStrategy",
    "CvMeasuringStopStrategy",
    "MeasuringStopStrategy",
    "ModelExecutionTimeMeasuringStrategy",
    "NumStepsMeasuringStopStrategy",
    "ProfileResult",
    "ProfilingConfig",
    "ProfilingStopStrategy",
    "ThroughputSaturatedProfilingStopStrategy",
    "profile_runners",
]


@attrs.frozen
class ModelExecutionTimeMeasuringStrategy:
    """Times one call: CUDA events on a GPU, ``perf_counter_ns`` on the CPU."""

    def measure(self, fn: Callable[[], Any], device: torch.device) -> float:
        """Milliseconds one call of ``fn`` took."""
        if device.type == "cuda":
            with torch.cuda.device(device):  # the events time ``device``'s stream, whichever device is current
                stream = torch.cuda.current_stream(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                fn()
                end.record(stream)
                end.synchronize()
            return float(start.elapsed_time(end))
        t0 = time.perf_counter_ns()
        fn()
        return (time.perf_counter_ns() - t0) / 1e6


class MeasuringStopStrategy(Protocol):
    """Decides how many timed steps a runner needs: ``warmup`` untimed calls, then windows of
    ``window`` timed calls until ``done`` (never more than ``max_steps``)."""

    @property
    def warmup(self) -> int: ...

    @property
    def window(self) -> int: ...

    @property
    def max_steps(self) -> int: ...

    def done(self, times_ms: Sequence[float]) -> bool: ...


@attrs.frozen
class NumStepsMeasuringStopStrategy:
    """A fixed number of timed steps per runner, after ``warmup`` untimed ones; with ``max_timed_s``,
    fewer for a slow call: a runner is done once it has :data:`BEHIND_WINDOWS` whole windows and that
    many seconds of timed calls (where a call takes tens of milliseconds, three windows of them are
    seconds of measurement, and the rest of ``num_steps`` would add tune time, not a better decision)."""

    num_steps: int = attrs.field(default=60, validator=attrs.validators.ge(1))
    warmup: int = attrs.field(default=5, validator=attrs.validators.ge(0))
    window: int = attrs.field(default=10, validator=attrs.validators.ge(1))
    max_timed_s: float | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.gt(0.0)))

    @property
    def max_steps(self) -> int:
        return self.num_steps

    def done(self, times_ms: Sequence[float]) -> bool:
        if len(times_ms) >= self.num_steps:
            return True
        return (
            self.max_timed_s is not None
            and len(times_ms) >= BEHIND_WINDOWS * self.window
            and sum(times_ms) >= self.max_timed_s * 1000.0
        )


TIMED_S = 1.5
"""The default profiling's :attr:`NumStepsMeasuringStopStrategy.max_timed_s`: at a BERT's batch 8 on
two CPU cores (60-80 ms a call) profiling stops after 30 steps instead of 60, at batch 1 never."""


def _default_stop() -> NumStepsMeasuringStopStrategy:
    return NumStepsMeasuringStopStrategy(max_timed_s=TIMED_S)


@attrs.frozen
class CvMeasuringStopStrategy:
    """Measure until the last ``stable_windows`` window medians agree within ``max_cv``.

    The coefficient of variation (std / mean) of recent window medians says whether the figure
    has settled; ``max_steps`` bounds the time spent on a noisy machine.
    """

    max_cv: float = attrs.field(default=0.05, validator=attrs.validators.gt(0.0))
    min_steps: int = attrs.field(default=30, validator=attrs.validators.ge(1))
    max_steps: int = attrs.field(default=300, validator=attrs.validators.ge(1))
    warmup: int = attrs.field(default=5, validator=attrs.validators.ge(0))
    window: int = attrs.field(default=10, validator=attrs.validators.ge(1))
    stable_windows: int = attrs.field(default=3, validator=attrs.validators.ge(2))

    def done(self, times_ms: Sequence[float]) -> bool:
        if len(times_ms) >= self.max_steps:
            return True
        if len(times_ms) < max(self.min_steps, self.window * self.stable_windows):
            return False
        medians = [
            statistics.median(times_ms[i : i + self.window])
            for i in range(len(times_ms) - self.window * self.stable_windows, len(times_ms), self.window)
        ]
        mean = statistics.fmean(medians)
        return mean > 0 and statistics.pstdev(medians) / mean <= self.max_cv


def _above_one(_: Any, attribute: Any, value: float | None) -> None:
    if value is not None and not value > 1.0:
        raise ValueError(f"ProfilingConfig.{attribute.name} must be a ratio above 1 (or None), got {value!r}")


BEHIND_WINDOWS = 3
"""How many whole windows a runner and the one it is behind both have before it may stop being timed."""


@attrs.frozen
class ProfilingConfig:
    """How candidates are profiled.

    ``batch_sizes=None`` lets the strategy choose: every recorded batch size for throughput
    strategies, batch size 1 for MinLatency, the most common recorded size for the eager gate of
    OneBackend and FirstWins. ``dispatch_cost_ms=None`` measures what the ``ait.Module``
    dispatcher adds to each call and charges it to every candidate; a number fixes it.

    ``max_noise`` is the widest interval shown as a figure (its half-width as a share of the
    speed-up; ±10% by default): after the stop strategy is satisfied, profiling adds windows, up
    to ``extend_s`` seconds more per session, while any runner's window medians spread wider
    than half of it, so a burst of interference is outvoted; a speed-up whose interval is still
    wider is reported as "not measured: noise ±N%".
    """

    batch_sizes: Sequence[int] | None = attrs.field(default=None, converter=lambda v: tuple(v) if v else None)
    measuring_strategy: ModelExecutionTimeMeasuringStrategy = attrs.field(factory=ModelExecutionTimeMeasuringStrategy)
    measurement_stop_strategy: MeasuringStopStrategy = attrs.field(factory=_default_stop)
    profiling_stop_strategy: ProfilingStopStrategy = attrs.field(factory=AllSamplesProfilingStopStrategy)
    dispatch_cost_ms: float | None = attrs.field(default=None)
    max_noise: float = attrs.field(default=MAX_NOISE, validator=attrs.validators.gt(0.0))
    extend_s: float = attrs.field(default=5.0, validator=attrs.validators.ge(0.0))
    behind: float | None = attrs.field(default=1.25, validator=_above_one)
    """A runner (not the first, which the others are paired with) whose fastest of at least
    :data:`BEHIND_WINDOWS` windows is this many times slower than another runner's slowest stops
    being timed: no window of it came near, so more of them would not change the decision. Its
    figure comes from the windows it has, paired with the baseline's windows of the same rounds.
    None times every runner to the end."""


def _percentile(sorted_ms: Sequence[float], q: float) -> float:
    if not sorted_ms:
        return float("nan")
    k = (len(sorted_ms) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (k - lo)


def summarize(times_ms: Sequence[float], batch_size: int, window: int) -> ProfileResult:
    """The figures of one runner. Throughput comes from the median, not the mean: a few calls the
    machine interrupted must not reorder candidates (the mean of 0.07 ms calls with three 4 ms
    outliers is 0.27 ms)."""
    s = sorted(times_ms)
    mean = statistics.fmean(s)
    p50 = _percentile(s, 0.5)
    windows = window_medians(times_ms, window)
    return ProfileResult(
        batch_size=batch_size,
        steps=len(s),
        mean_ms=mean,
        p50_ms=p50,
        p90_ms=_percentile(s, 0.9),
        p99_ms=_percentile(s, 0.99),
        std_ms=statistics.pstdev(s) if len(s) > 1 else 0.0,
        min_ms=s[0],
        throughput=batch_size / (p50 / 1000.0) if p50 > 0 else float("inf"),
        window_p50_ms=windows,
    )


def _nothing() -> None:
    return None


def profile_runners(
    runners: Mapping[str, Callable[[], Any]],
    batch_size: int,
    config: ProfilingConfig,
    device: torch.device,
) -> dict[str, ProfileResult]:
    """Time each runner in alternating, rotated windows until its stop strategy is satisfied, or
    until it is clearly behind another (``config.behind``; never the first runner, the baseline the
    others are paired with).

    A runner with a ``prepare`` attribute (one that restores inputs a call updates in place) has
    it called before each call, outside the timed region.
    """
    stop = config.measurement_stop_strategy
    measure = config.measuring_strategy.measure
    names = list(runners)
    prepares = {n: getattr(runners[n], "prepare", None) or _nothing for n in names}
    with torch.no_grad():
        for name in names:
            for _ in range(stop.warmup):
                prepares[name]()
                runners[name]()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times: dict[str, list[float]] = {n: [] for n in names}
        rotation = 0

        def one_round(among: list[str], capped: bool) -> None:
            """One window per runner of ``among``, interleaved, starting one further each round."""
            nonlocal rotation
            order = among[rotation % len(among) :] + among[: rotation % len(among)]
            rotation += 1
            for name in order:
                for _ in range(stop.window):
                    prepares[name]()
                    times[name].append(measure(runners[name], device))
                    if capped and len(times[name]) >= stop.max_steps:
                        break

        timed = list(names)
        while pending := [n for n in timed if not stop.done(times[n])]:
            if names[0] not in pending:  # the baseline times a window in every round another runner does
                pending.insert(0, names[0])
            one_round(pending, capped=True)
            behind = clearly_behind(times, names, stop.window, config.behind)
            timed = [n for n in timed if n not in behind]
        deadline = time.perf_counter() + config.extend_s
        while config.extend_s > 0 and time.perf_counter() < deadline:
            if all(window_spread(times[n], stop.window) <= config.max_noise / 2 for n in timed):
                break
            one_round(timed, capped=False)  # one more window each, still interleaved
    return {n: summarize(times[n], batch_size, stop.window) for n in names}


def clearly_behind(
    times_ms: Mapping[str, Sequence[float]], names: Sequence[str], window: int, ratio: float | None
) -> set[str]:
    """The runners after the first whose fastest whole window is ``ratio`` times another's slowest
    (both with at least :data:`BEHIND_WINDOWS` whole windows); none when ``ratio`` is None."""
    if ratio is None:
        return set()
    medians = {n: window_medians(times_ms[n][: len(times_ms[n]) // window * window], window) for n in names}
    ready = {n: m for n, m in medians.items() if len(m) >= BEHIND_WINDOWS}
    if len(ready) < 2:
        return set()
    leader_slowest = min(max(m) for m in ready.values())
    return {n for n in names[1:] if n in ready and min(ready[n]) > ratio * leader_slowest}


def window_spread(times_ms: Sequence[float], window: int) -> float:
    """Half the interquartile range of a runner's window medians, as a share of their median
    (min to max below four windows): how far apart its windows still are."""
    medians = window_medians(times_ms, window)
    if len(medians) < 2:
        return 0.0
    low, high = spread(medians)
    middle = statistics.median(medians)
    return (high - low) / (2 * middle) if middle > 0 else 0.0


def window_medians(times_ms: Sequence[float], window: int) -> list[float]:
    return [statistics.median(times_ms[i : i + window]) for i in range(0, len(times_ms), window)]


def spread(values: Sequence[float]) -> tuple[float, float]:
    """The lower and upper quartiles of ``values`` (their min and max below four values): the
    interval every figure aitune shows comes with."""
    if len(values) < 4:
        return min(values), max(values)
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]
