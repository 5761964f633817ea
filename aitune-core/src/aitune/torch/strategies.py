"""Tune strategies: which candidates to build, and how to pick the winner.

The rules follow the product's strategy guide exactly:

* ``OneBackendStrategy``: one backend; a build or correctness failure raises the original error;
  correct but not at least ``1 + min_speedup_ratio`` times faster than eager falls back to eager.
* ``FirstWinsStrategy``: backends in order; the first that builds, is correct and passes that
  gate wins; if none does, the module runs eager and the report says why each failed.
* ``MaxThroughputStrategy`` / ``MinLatencyStrategy``: build and profile all; the best must strictly
  beat eager (ties go to eager). MinLatency always profiles at batch size 1.
* ``LatencyBudgetStrategy``: the highest throughput (backend, batch size) within the budget;
  raises when no backend meets it.

Beyond the guide: when a gap is inside the measured spread (the lower quartile of per-window
speedups does not clear the bar) the simpler choice, eager, is kept and the report says so.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

from ..backend import Backend
from ..errors import BuildError, TuningError, ValidationError
from .candidates import Candidate, GraphTuning, Route, compare
from .task.profiling import ProfilingConfig


class PerformanceValidationMode(enum.Enum):
    """How strategies use the eager baseline."""

    ENABLED = "enabled"
    """Profile eager too; a candidate must beat it (by the strategy's rule) to be chosen."""
    DISABLED = "disabled"
    """Skip the baseline; the best correct candidate wins."""
    DIAGNOSTIC = "diagnostic"
    """Profile eager and report speedups, but choose as if disabled."""


class TuneStrategy:
    """Base of every strategy: the candidate backends, profiling settings and the eager gate."""

    raises_on_failure: bool = False
    """True when a failure of this strategy must reach the user instead of leaving the module eager."""

    def __init__(
        self,
        backends: Sequence[Backend] | None = None,
        profiling_config: ProfilingConfig | None = None,
        performance_validation: bool | PerformanceValidationMode = True,
    ) -> None:
        self.backends: list[Backend] | None = list(backends) if backends is not None else None
        for b in self.backends or []:
            if not isinstance(b, Backend):
                raise TypeError(f"{type(self).__name__} takes Backend objects, got {b!r}")
        self.profiling_config = profiling_config or ProfilingConfig()
        self.performance_validation = PerformanceValidationMode.ENABLED
        self.enable_performance_validation(performance_validation)

    def enable_performance_validation(self, enabled: bool | PerformanceValidationMode = True) -> TuneStrategy:
        """Turn the eager baseline gate on or off, or to diagnostic mode (measure, report, do not gate)."""
        if isinstance(enabled, PerformanceValidationMode):
            self.performance_validation = enabled
        else:
            self.performance_validation = (
                PerformanceValidationMode.ENABLED if enabled else PerformanceValidationMode.DISABLED
            )
        return self

    @property
    def gated(self) -> bool:
        return self.performance_validation is PerformanceValidationMode.ENABLED

    @property
    def with_baseline(self) -> bool:
        return self.performance_validation is not PerformanceValidationMode.DISABLED

    def candidates(self, default: Sequence[Backend]) -> list[Backend]:
        return list(self.backends) if self.backends is not None else list(default)

    def tune(self, tuning: GraphTuning, default_backends: Sequence[Backend]) -> Candidate | list[Route] | None:
        """Pick the winner for one graph (None means eager), or one per batch range, recording the decision."""
        raise NotImplementedError

    def __repr__(self) -> str:
        names = [b.name for b in self.backends] if self.backends is not None else "default"
        return f"{type(self).__name__}(backends={names})"


class _GateStrategy(TuneStrategy):
    """OneBackend and FirstWins: a candidate must be ``1 + min_speedup_ratio`` times faster."""

    def __init__(
        self,
        backends: Sequence[Backend] | None = None,
        profiling_config: ProfilingConfig | None = None,
        min_speedup_ratio: float = 0.01,
        performance_validation: bool | PerformanceValidationMode = True,
    ) -> None:
        super().__init__(backends, profiling_config, performance_validation)
        if min_speedup_ratio < 0:
            raise ValueError("min_speedup_ratio must be >= 0")
        self.min_speedup_ratio = min_speedup_ratio

    def _gate(self, tuning: GraphTuning, candidate: Candidate) -> tuple[bool, str, int | None]:
        """Whether ``candidate`` passes the eager gate, why, and the batch size it was judged at."""
        if not self.with_baseline:
            return True, "performance validation disabled", None
        sizes = tuning.default_batch_sizes(self.profiling_config)
        measured = tuning.profile([candidate], self.profiling_config, True, sizes)
        if not measured:
            return False, "could not be profiled (out of memory)", None
        batch = max(measured)
        eager, mine = tuning.eager_profile(batch), candidate.profile_at(batch)
        assert eager is not None and mine is not None
        cmp = compare(mine, eager)
        candidate.report.speedup = cmp.speedup
        bar = 1.0 + self.min_speedup_ratio
        figures = f"{cmp.speedup:.2f}x eager (p50 {mine.p50_ms:.3g} ms vs {eager.p50_ms:.3g} ms) at batch {batch}"
        if not self.gated:
            return True, f"{figures}; diagnostic mode, not gated", batch
        if cmp.speedup < bar:
            return False, f"{figures}, below the required {bar:.2f}x", batch
        if cmp.low_speedup < bar:
            return False, f"{figures}, but inside the measured spread (low {cmp.low_speedup:.2f}x < {bar:.2f}x)", batch
        return True, figures, batch


class OneBackendStrategy(_GateStrategy):
    """Exactly one backend: deterministic, raises on failure, falls back to eager when not faster."""

    raises_on_failure = True

    def __init__(
        self,
        backend: Backend,
        profiling_config: ProfilingConfig | None = None,
        min_speedup_ratio: float = 0.01,
        performance_validation: bool | PerformanceValidationMode = True,
    ) -> None:
        super().__init__([backend], profiling_config, min_speedup_ratio, performance_validation)
        self.backend = backend

    def tune(self, tuning: GraphTuning, default_backends: Sequence[Backend]) -> Candidate | None:
        candidate = tuning.build(self.backend)
        if not candidate.ok:
            if candidate.error is not None:
                raise candidate.error
            raise BuildError(f"{tuning.module_name}: {candidate.name} cannot be used: {candidate.report.reason}")
        if not tuning.validate(candidate):
            raise ValidationError(
                f"{tuning.module_name}: {candidate.name} does not match eager: {candidate.report.reason}"
            )
        passed, why, batch = self._gate(tuning, candidate)
        if passed:
            tuning.finish(candidate, why, batch)
            return candidate
        candidate.report.status = "rejected"
        candidate.report.reason = why
        tuning.finish(None, f"{candidate.name} is correct but not faster: {why}; falling back to eager", batch)
        return None


class FirstWinsStrategy(_GateStrategy):
    """Backends in priority order; the first that builds, is correct and is faster wins."""

    def tune(self, tuning: GraphTuning, default_backends: Sequence[Backend]) -> Candidate | None:
        reasons = []
        for template in self.candidates(default_backends):
            candidate = tuning.build(template)
            if candidate.ok and tuning.validate(candidate):
                passed, why, batch = self._gate(tuning, candidate)
                if passed:
                    tuning.finish(candidate, f"first to pass: {why}", batch)
                    return candidate
                candidate.report.status = "rejected"
                candidate.report.reason = why
            reasons.append(f"{candidate.name}: {candidate.report.reason}")
        tuning.finish(None, "no backend passed; running eager. " + "; ".join(reasons) if reasons else "no backends")
        return None


class _ProfilingStrategy(TuneStrategy):
    """Build and validate every backend, profile the correct ones, pick by a figure of merit."""

    def _correct(self, tuning: GraphTuning, default_backends: Sequence[Backend]) -> list[Candidate]:
        correct = []
        for template in self.candidates(default_backends):
            candidate = tuning.build(template)
            if candidate.ok and tuning.validate(candidate):
                correct.append(candidate)
        return correct

    def _batch_sizes(self, tuning: GraphTuning) -> list[int]:
        return tuning.default_batch_sizes(self.profiling_config)

    def _score(self, candidate: Candidate, batch: int) -> float:
        """Higher is better."""
        raise NotImplementedError

    def tune(self, tuning: GraphTuning, default_backends: Sequence[Backend]) -> Candidate | list[Route] | None:
        correct = self._correct(tuning, default_backends)
        measured: list[int] = []
        if correct and not (len(correct) == 1 and not self.with_baseline):
            measured = tuning.profile(correct, self.profiling_config, self.with_baseline, self._batch_sizes(tuning))
        return self._decide(tuning, correct, measured)

    def _decide(self, tuning: GraphTuning, correct: list[Candidate], measured: list[int]) -> Candidate | None:
        if not correct:
            failures = "; ".join(f"{c.backend}: {c.reason}" for c in tuning.report.candidates)
            tuning.finish(None, f"no backend built and passed validation; running eager. {failures}")
            return None
        if len(correct) == 1 and not self.with_baseline:
            tuning.finish(correct[0], "the only correct backend (performance validation disabled)")
            return correct[0]
        if not measured:
            tuning.finish(None, "nothing could be profiled (out of memory); running eager")
            return None
        best, best_batch, best_score = None, None, float("-inf")
        for candidate in correct:
            for batch in measured:
                if candidate.profile_at(batch) is not None and self._score(candidate, batch) > best_score:
                    best, best_batch, best_score = candidate, batch, self._score(candidate, batch)
        if best is None or best_batch is None:
            tuning.finish(None, "no correct backend qualifies at the profiled batch sizes; running eager")
            return None
        for candidate in correct:
            eager = tuning.eager_profile(best_batch)
            mine = candidate.profile_at(best_batch)
            if eager is not None and mine is not None:
                candidate.report.speedup = compare(mine, eager).speedup
        if not self.gated:
            tuning.finish(best, f"best {self._figure(best, best_batch)} (performance validation off)", best_batch)
            return best
        eager = tuning.eager_profile(best_batch)
        mine = best.profile_at(best_batch)
        assert eager is not None and mine is not None
        cmp = compare(mine, eager)
        figures = f"{self._figure(best, best_batch)}, {cmp.speedup:.2f}x eager (p50 {mine.p50_ms:.3g} ms vs {eager.p50_ms:.3g} ms)"
        if cmp.speedup <= 1.0:
            tuning.finish(None, f"eager is as fast or faster than the best backend ({figures})", best_batch)
            return None
        if cmp.low_speedup <= 1.0:
            tuning.finish(None, f"{figures}, but the gap is inside the measured spread; keeping eager", best_batch)
            return None
        tuning.finish(best, figures, best_batch)
        return best

    def _figure(self, candidate: Candidate, batch: int) -> str:
        p = candidate.profile_at(batch)
        assert p is not None
        return f"{candidate.name} at batch {batch}: {p.throughput:.1f} samples/s, p50 {p.p50_ms:.3g} ms"


class MaxThroughputStrategy(_ProfilingStrategy):
    """Profiles every backend and keeps the highest throughput that beats eager.

    With ``per_batch_size=True`` each profiled batch size gets its own fastest backend (or eager
    when none beats it there), and calls are routed by batch size: ranges split at the geometric
    mean of neighbouring profiled sizes. For serving mixed batch sizes, where the backend that wins
    at 32 can lose by a third at 1.
    """

    def __init__(
        self,
        backends: Sequence[Backend] | None = None,
        profiling_config: ProfilingConfig | None = None,
        performance_validation: bool | PerformanceValidationMode = True,
        per_batch_size: bool = False,
    ) -> None:
        super().__init__(backends, profiling_config, performance_validation)
        self.per_batch_size = per_batch_size

    def _score(self, candidate: Candidate, batch: int) -> float:
        p = candidate.profile_at(batch)
        return p.throughput if p else float("-inf")

    def _batch_sizes(self, tuning: GraphTuning) -> list[int]:
        sizes = tuning.default_batch_sizes(self.profiling_config)
        batch = tuning.graph.batch
        if self.per_batch_size and batch is not None and len(sizes) == 1:
            return sorted({batch.min, batch.opt, batch.max})
        return sizes

    def tune(self, tuning: GraphTuning, default_backends: Sequence[Backend]) -> Candidate | list[Route] | None:
        if not self.per_batch_size or tuning.graph.batch is None:
            return super().tune(tuning, default_backends)
        correct = self._correct(tuning, default_backends)
        measured = (
            tuning.profile(correct, self.profiling_config, self.with_baseline, self._batch_sizes(tuning))
            if correct
            else []
        )
        if len(measured) < 2:
            return super()._decide(tuning, correct, measured)
        winners: list[tuple[int, Candidate | None, str]] = []
        for size in measured:
            best = max(correct, key=lambda c: self._score(c, size))
            mine, eager = best.profile_at(size), tuning.eager_profile(size)
            if mine is None:
                winners.append((size, None, "not measured"))
                continue
            if not self.gated or eager is None:
                winners.append((size, best, f"{best.name} at batch {size}"))
                continue
            cmp = compare(mine, eager)
            beats = cmp.speedup > 1.0 and cmp.low_speedup > 1.0
            winners.append(
                (
                    size,
                    best if beats else None,
                    f"{best.name if beats else 'eager'} at batch {size} ({cmp.speedup:.2f}x)",
                )
            )
        routes = _routes(tuning.graph.batch.min, tuning.graph.batch.max, winners)
        tuning.finish_routes(routes, "per batch size: " + "; ".join(why for _, _, why in winners))
        return routes


def _routes(low: int, high: int, winners: list[tuple[int, Candidate | None, str]]) -> list[Route]:
    """Batch ranges from per-size winners: split at the geometric mean of neighbours, merge equal ones."""
    routes: list[Route] = []
    start = low
    for i, (size, candidate, _) in enumerate(winners):
        end = high if i == len(winners) - 1 else max(start, math.isqrt(size * winners[i + 1][0]))
        if routes and routes[-1].candidate is candidate:
            routes[-1] = Route(routes[-1].batch_min, end, candidate)
        else:
            routes.append(Route(start, end, candidate))
        start = end + 1
    return [r for r in routes if r.batch_min <= r.batch_max]


class MinLatencyStrategy(_ProfilingStrategy):
    """Profiles every backend at batch size 1 and keeps the lowest latency that beats eager."""

    def _batch_sizes(self, tuning: GraphTuning) -> list[int]:
        batch = tuning.graph.batch
        if batch is not None and 1 not in batch:
            raise TuningError(
                f"{tuning.module_name}: MinLatencyStrategy profiles at batch size 1, but the graph was tuned "
                f"for batch sizes {batch.min}..{batch.max}; record a batch of 1 or pass batch_sizes=[1, ...]"
            )
        return [1] if batch is not None else tuning.default_batch_sizes(self.profiling_config)

    def _score(self, candidate: Candidate, batch: int) -> float:
        p = candidate.profile_at(batch)
        return -p.p50_ms if p else float("-inf")


class LatencyBudgetStrategy(_ProfilingStrategy):
    """The highest throughput (backend, batch size) whose p50 latency stays within the budget."""

    raises_on_failure = True

    def __init__(
        self,
        latency_budget_ms: float,
        backends: Sequence[Backend] | None = None,
        profiling_config: ProfilingConfig | None = None,
        performance_validation: bool | PerformanceValidationMode = True,
    ) -> None:
        if latency_budget_ms <= 0:
            raise ValueError("latency_budget_ms must be > 0")
        super().__init__(backends, profiling_config, performance_validation)
        self.latency_budget_ms = latency_budget_ms

    def _batch_sizes(self, tuning: GraphTuning) -> list[int]:
        batch = tuning.graph.batch
        wanted = self.profiling_config.batch_sizes or tuning.batch_sizes
        if batch is None or wanted:
            return tuning.default_batch_sizes(self.profiling_config)
        return sorted({batch.min, batch.opt, batch.max})

    def _score(self, candidate: Candidate, batch: int) -> float:
        p = candidate.profile_at(batch)
        if p is None or p.p50_ms > self.latency_budget_ms:
            return float("-inf")
        return p.throughput

    def tune(self, tuning: GraphTuning, default_backends: Sequence[Backend]) -> Candidate | list[Route] | None:
        result = super().tune(tuning, default_backends)
        within = [c for c in tuning.report.candidates if any(p.p50_ms <= self.latency_budget_ms for p in c.profiles)]
        if not within:
            raise TuningError(
                f"{tuning.module_name}: no backend stays within the latency budget of {self.latency_budget_ms} ms "
                f"at the profiled batch sizes; best p50 per backend: "
                + ", ".join(
                    f"{c.backend} {min(p.p50_ms for p in c.profiles):.3g} ms"
                    for c in tuning.report.candidates
                    if c.profiles
                )
                + ". Raise the budget or profile smaller batch sizes."
            )
        return result
