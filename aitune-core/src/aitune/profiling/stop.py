"""When to stop sweeping batch sizes."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from ..report import ProfileResult


class ProfilingStopStrategy:
    """Decides after each batch size whether profiling larger ones is still worth it."""

    def should_stop(self, history: Sequence[ProfileResult]) -> bool:
        raise NotImplementedError


@attrs.frozen
class AllSamplesProfilingStopStrategy(ProfilingStopStrategy):
    """Profile every configured batch size."""

    def should_stop(self, history: Sequence[ProfileResult]) -> bool:
        return False


@attrs.frozen
class ThroughputSaturatedProfilingStopStrategy(ProfilingStopStrategy):
    """Stop once throughput grew by less than ``min_gain`` for ``patience`` batch sizes in a row."""

    min_gain: float = attrs.field(default=0.05, validator=attrs.validators.ge(0.0))
    patience: int = attrs.field(default=2, validator=attrs.validators.ge(1))

    def should_stop(self, history: Sequence[ProfileResult]) -> bool:
        if len(history) <= self.patience:
            return False
        best_before = max(r.throughput for r in history[: -self.patience])
        recent = max(r.throughput for r in history[-self.patience :])
        return recent < best_before * (1.0 + self.min_gain)
