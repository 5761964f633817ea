"""Deferred JIT tuning, for pipelines that call modules a varying number of times per step.

Set ``aitune.torch.jit.config.deferred = True`` (or ``AITUNE_JIT_DEFERRED=1``), run a few
representative steps (they are recorded, not tuned), then call ``deferred()``: each recorded
module is tuned at its next forward call.
"""

from __future__ import annotations

import logging

from . import hooks

logger = logging.getLogger("aitune")


def deferred() -> None:
    """Tune every module recorded so far at its next forward call.

    Modules uncovered later (the children of a module that stays eager) record until the next
    call of ``deferred()``. Without JIT mode on, this does nothing, so a script runs unchanged
    with and without ``AITUNE_JIT``.
    """
    if not hooks.enabled():
        logger.debug("aitune jit: deferred() called while JIT tuning is off; nothing to do")
        return
    hooks.request_tuning()
