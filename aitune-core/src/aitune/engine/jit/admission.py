"""Which modules the JIT takes on, and the twin it tunes in their place.

A module is admitted when the program calls it from outside any other module's forward, or when
its parent stays eager and hands over to its children. Modules aitune cannot or should not tune
(an ``ait.Module``, compiled code, excluded or too small) are marked skipped for good. An admitted
module records through a *twin*: a shallow copy sharing its parameters, buffers and submodules
but not its hooks or patched ``forward``, so backends compile the module's own code.
"""

from __future__ import annotations

import copy
import logging

import torch

from ..install import TunedForward
from ..module import Module
from ..recording import Recording
from .settings import settings
from .state import STATE, JitCandidate, ModuleState

logger = logging.getLogger("aitune")

MAX_SAMPLES = 8
"""Samples kept per graph of a candidate (distinct shapes preferred), as in ``ait.tune``."""


def skip_reason(module: torch.nn.Module, name: str) -> str | None:
    """Why the JIT leaves ``module`` alone, or None when it may tune it."""
    cls = type(module)
    if isinstance(module, Module):
        return "it is an ait.Module (tuned ahead of time)"
    if cls.__module__.startswith("torch._dynamo") or isinstance(module, torch.jit.ScriptModule):
        return "it is already compiled (torch.compile or TorchScript)"
    if cls.forward is torch.nn.Module.forward:
        return "it has no forward"
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    for prefix in settings.exclude:
        if cls.__name__.startswith(prefix) or qualified.startswith(prefix) or name.startswith(prefix):
            return f"excluded by {prefix!r}"
    count = sum(p.numel() for p in module.parameters())
    if count < settings.min_parameters:
        return f"{count} parameters, fewer than min_parameters={settings.min_parameters}"
    return None


def twin(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy that shares parameters, buffers and submodules, without hooks or a patched forward."""
    copied = copy.copy(module)
    hooks = ("_forward_", "_backward_", "_state_dict_", "_load_state_dict_")
    for name, value in list(vars(module).items()):
        if name.startswith(hooks) and isinstance(value, dict):
            copied.__dict__[name] = type(value)()
        elif name.startswith(hooks) and isinstance(value, set):
            copied.__dict__[name] = set()
    if isinstance(copied.__dict__.get("forward"), TunedForward):
        del copied.__dict__["forward"]
    return copied


def admit(module: torch.nn.Module, name: str, depth: int) -> ModuleState:
    """Start recording ``module`` as a candidate, or mark it skipped; returns its new state."""
    reason = skip_reason(module, name)
    if reason:
        logger.info("aitune jit: not tuning %s: %s", name, reason)
        STATE.modules[module] = "skipped"
        return "skipped"
    shadow = twin(module)
    candidate = JitCandidate(name, depth, shadow, Module(shadow, name), Recording(MAX_SAMPLES), STATE.requests)
    STATE.modules[module] = candidate
    STATE.names[module] = name
    return candidate
