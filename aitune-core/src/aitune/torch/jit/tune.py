"""``deferred()``: tune every module recorded so far at its next forward call (deferred JIT mode)."""

from __future__ import annotations

from ...engine.jit.tune import deferred

__all__ = ["deferred"]
