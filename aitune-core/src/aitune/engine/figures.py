"""The figures a decision rests on: a candidate against eager, and what a call through the wrapper adds.

Strategies rank, gate and report by :func:`compare` (one figure, the paired p50 speedup, with its
interval), routing by batch size asks for a confident lead between two candidates (:func:`lead`),
every candidate's latency includes the measured dispatch cost (:func:`with_dispatch`), and several
ranks can make their figures one (:class:`SharedFigures`) so each decides alike.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch

from ..graph import GraphSpec, Sample
from ..profiling import spread
from ..report import MAX_NOISE, ProfileResult, format_speedup, noise_of
from . import recording


@attrs.frozen
class Comparison:
    """A candidate against a baseline (eager, or another candidate) timed in the same round."""

    speedup: float
    """Baseline p50 over candidate p50: the figure candidates are ranked by, gated on and shown with."""
    low_speedup: float
    """The lower end of its interval: the lower quartile of the per-window ratios (baseline window
    p50 over the candidate's, window for window). A candidate clearly beats a bar only when it does
    so in at least three windows of four; otherwise the gap is inside the measured spread. Windows
    where the baseline was unlucky only raise the upper quartiles, so they cannot hide a real win."""
    high_speedup: float
    """The upper end: the upper quartile of those ratios."""

    @property
    def noise(self) -> float:
        """The interval's half-width as a share of the speed-up (0.1: ±10%)."""
        return noise_of(self.speedup, self.low_speedup, self.high_speedup)

    def measured(self, max_noise: float = MAX_NOISE) -> bool:
        return self.noise <= max_noise

    def describe(self, max_noise: float = MAX_NOISE) -> str:
        return format_speedup(self.speedup, self.low_speedup, self.high_speedup, self.measured(max_noise))


def compare(candidate: ProfileResult, baseline: ProfileResult | None = None) -> Comparison:
    """``candidate`` against ``baseline``, or against the eager windows of its own round.

    The interval is widened to contain the point figure, so a reader never sees a speedup outside
    the interval printed next to it.
    """
    if baseline is not None:
        base_p50, base_windows = baseline.p50_ms, baseline.window_p50_ms
    elif candidate.baseline_p50_ms is not None:
        base_p50, base_windows = candidate.baseline_p50_ms, candidate.baseline_window_p50_ms
    else:
        raise ValueError("compare() needs a baseline: this result was profiled without eager")
    speedup = base_p50 / candidate.p50_ms if candidate.p50_ms > 0 else float("inf")
    ratios = [e / c for e, c in zip(base_windows, candidate.window_p50_ms) if c > 0]
    low, high = spread(ratios) if len(ratios) >= 2 else (speedup, speedup)
    return Comparison(speedup, min(low, speedup), max(high, speedup))


T_90 = (3.078, 1.886, 1.638, 1.533, 1.476, 1.440, 1.415, 1.397, 1.383, 1.372, 1.363, 1.356, 1.350, 1.345, 1.341,
        1.337, 1.333, 1.330, 1.328, 1.325, 1.323, 1.321, 1.319, 1.318, 1.316, 1.315, 1.314, 1.313, 1.311, 1.310)  # fmt: skip
"""Student's t, one-sided 90%, for 1..30 degrees of freedom; past 30 the last (a bound slightly
wider than the exact one)."""


@attrs.frozen
class Lead:
    """How much faster one runner is than another, from their paired windows (each pair timed side
    by side in one round): the geometric mean of the per-window ratios, and a one-sided 90%
    confidence bound below it (Student's t on the log ratios).

    Unlike the quartiles of :class:`Comparison`, which describe how the windows spread, the bound
    narrows as windows are added: a steady 3% lead over six windows that scatter by 3% is a lead,
    even where one window in three went the other way.
    """

    ratio: float
    low: float
    windows: int

    def describe(self) -> str:
        return f"{self.ratio:.3f}x, at least {self.low:.3f}x at 90% confidence over {self.windows} paired windows"


def lead(faster: Sequence[float], slower: Sequence[float]) -> Lead | None:
    """``slower``'s window medians over ``faster``'s, window for window; None under three pairs (no spread to bound)."""
    logs = [math.log(s / f) for f, s in zip(faster, slower) if f > 0 and s > 0]
    if len(logs) < 3:
        return None
    mean = statistics.fmean(logs)
    margin = T_90[min(len(logs) - 1, len(T_90)) - 1] * statistics.stdev(logs) / math.sqrt(len(logs))
    return Lead(math.exp(mean), math.exp(mean - margin), len(logs))


@attrs.frozen
class ProfileOutcome:
    """What one profiling round gave: every runner's result, or out of memory, or the runner that raised."""

    results: Mapping[str, ProfileResult] | None = None
    out_of_memory: bool = False
    failed_key: str | None = None
    error: Exception | None = None
    baseline_key: str | None = None
    """The runner the others are paired with (eager), when it ran in the round."""


class SharedFigures(Protocol):
    """Figures measured by several processes made one, so that each decides the same way.

    ``ait.tune(..., rank_decision="slowest")`` hands every rank's :class:`GraphTuning` one that
    exchanges them with the other ranks and keeps the slowest (see :mod:`aitune.engine.ranks`).
    """

    def profiles(self, step: str, outcome: ProfileOutcome) -> ProfileOutcome:
        """This process's profiling round in, the one every process decides on out."""
        ...

    def cost_ms(self, step: str, value: float) -> float:
        """A cost measured here in, the one every process uses out."""
        ...


def with_dispatch(result: ProfileResult, dispatch_ms: float) -> ProfileResult:
    """``result`` as users will see it through ``ait.Module``: every latency plus the dispatch cost."""
    if dispatch_ms <= 0:
        return result
    p50 = result.p50_ms + dispatch_ms
    return attrs.evolve(
        result,
        mean_ms=result.mean_ms + dispatch_ms,
        p50_ms=p50,
        p90_ms=result.p90_ms + dispatch_ms,
        p99_ms=result.p99_ms + dispatch_ms,
        min_ms=result.min_ms + dispatch_ms,
        throughput=result.batch_size / (p50 / 1000.0),
        window_p50_ms=[w + dispatch_ms for w in result.window_p50_ms],
        dispatch_ms=dispatch_ms,
    )


def measure_dispatch_ms(graph: GraphSpec, sample: Sample, repeats: int = 5, calls: int = 100) -> float:
    """What routing one call through the ``ait.Module`` dispatcher costs beyond calling the backend.

    A do-nothing backend is called directly and through a dispatcher built for ``graph``, the way
    a tuned module routes calls (the inference guard, structure key, shape checks); the median
    difference per call is the cost. 0 when the sample does not reach the route.
    """
    from .dispatch import Dispatcher
    from .guard import Guard

    reached = [0]

    def backend(*args: Any, **kwargs: Any) -> None:
        reached[0] += 1

    def eager(*args: Any, **kwargs: Any) -> None:
        return None

    guard = Guard(torch.nn.Module().eval(), baked=())  # a module in eval mode, called under no_grad
    dispatcher = Dispatcher("dispatch-cost", eager, recording.Canonicalizer(eager), [(graph, backend)], guard=guard)
    args, kwargs = sample.args, sample.kwargs

    def per_call_ns(fn: Callable[[], Any]) -> float:
        timings = []
        for _ in range(repeats):
            start = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            timings.append((time.perf_counter_ns() - start) / calls)
        return statistics.median(timings)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dispatcher(args, kwargs)
        if reached[0] == 0:
            return 0.0
        routed = per_call_ns(lambda: dispatcher(args, kwargs))
        direct = per_call_ns(lambda: backend(*args, **kwargs))
    return max(0.0, (routed - direct) / 1e6)
