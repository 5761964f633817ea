"""Recording a candidate's calls, and starting its tuning once it has seen enough.

Only inference calls are recorded (with the recorder ``ait.tune`` uses): a call in training mode
or with autograd on is left alone, with one warning per module. A candidate is tuned after
``settings.min_samples`` calls or, in deferred mode, at its first call after ``tune.deferred()``;
one module is tuned at a time, and a call that finds tuning under way simply runs. In background
mode (the default) the tuning runs on a tuner thread and this call returns at once.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from . import background
from .decide import tune_candidate
from .settings import settings
from .state import STATE, JitCandidate

logger = logging.getLogger("aitune")


def _inputs_need_grad(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    values = list(args) + list(kwargs.values())
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def observe(module: torch.nn.Module, cand: JitCandidate, args: Any, kwargs: Any, output: Any) -> None:
    """Record one call of a candidate; tune it when it is ready."""
    if module.training or (
        torch.is_grad_enabled()
        and (_inputs_need_grad(args, kwargs) or any(p.requires_grad for p in module.parameters()))
    ):
        if not cand.warned:
            cand.warned = True
            logger.warning(
                "aitune jit: %s runs in training mode or with autograd on; JIT tuning covers inference only: "
                "call model.eval() and run it under torch.inference_mode() or torch.no_grad()",
                cand.name,
            )
        return
    cand.recording.record(cand.wrapper, args, kwargs, output)
    cand.calls += 1
    ready = STATE.requests > cand.since or (not settings.deferred and cand.calls >= settings.min_samples)
    if ready and STATE.tuning.acquire(blocking=False):
        if settings.mode == "background":
            background.start(module, cand)  # the tuner thread releases STATE.tuning
            return
        try:
            tune_candidate(module, cand)
        finally:
            STATE.tuning.release()
