"""How the background tuner times candidates while the program keeps calling: see :mod:`.background`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from ...profiling import ModelExecutionTimeMeasuringStrategy
from .settings import settings
from .state import STATE, check_stopping

IDLE_WAIT_S = 0.05
"""The longest a timed call waits for the caller's calls in flight to end."""


@attrs.frozen
class SharingMeasuringStrategy:
    """Times a call when the caller has none in flight, and keeps the tuner to its share of time."""

    inner: Any = attrs.field(factory=ModelExecutionTimeMeasuringStrategy)
    share: float = 0.5

    def measure(self, fn: Callable[[], Any], device: torch.device) -> float:
        check_stopping()
        deadline = time.perf_counter() + IDLE_WAIT_S
        while STATE.in_flight > 0 and time.perf_counter() < deadline:
            time.sleep(0.0005)
        elapsed = self.inner.measure(fn, device)
        if self.share < 1.0:
            time.sleep(elapsed / 1000.0 * (1.0 / self.share - 1.0))
        return float(elapsed)


def measuring_strategy() -> Any:
    """What the JIT's own strategy times with: sharing in background mode, plain inline."""
    if settings.mode == "background":
        return SharingMeasuringStrategy(share=settings.max_tuning_share)
    return ModelExecutionTimeMeasuringStrategy()
