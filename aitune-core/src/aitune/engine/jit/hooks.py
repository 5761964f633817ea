"""Switching JIT tuning on and off, and the two hooks that watch every module call.

Mechanism: two process-wide module hooks from torch's public API
(``torch.nn.modules.module.register_module_forward_pre_hook`` and
``register_module_forward_hook(with_kwargs=True, always_call=True)``). They track how deep the
current call is nested, so a module called from outside any other module's forward is a
top-level candidate, and hand each candidate's inference calls (inputs, kwargs and outputs) to
``observe``. No torch class is patched, and ``disable()`` removes both hooks. While TorchDynamo
traces, the hooks return at once, so compiled code never contains them.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from ... import tracing
from ...plugins import AituneManager, get_manager
from .. import recording
from ..install import reset
from . import background, preload
from .admission import admit
from .observe import observe
from .settings import settings
from .state import STATE, Decision, JitCandidate

logger = logging.getLogger("aitune")

_is_compiling = torch.compiler.is_compiling
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)
_COMPILE_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"


def enable(*, manager: AituneManager | None = None) -> None:
    """Turn JIT tuning on for this process (idempotent: a second call changes nothing).

    ``manager``: the plugin manager whose backends and hooks tune the modules (default: the
    process's, :func:`aitune.plugins.get_manager`). In background mode (the default) what tuning
    will import, plugins included, is imported here, before the program serves (``config.preload``,
    :mod:`.preload`); in inline mode, or with ``preload`` off, plugins load when the first module is tuned.
    """
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    with STATE.lock:
        if STATE.handles:
            return
        STATE.manager_source = get_manager if manager is None else (lambda: manager)
        if settings.mode == "background":
            background.prepare()  # at start-up, not inside the call that starts the first tuning
            if settings.preload:  # what the tuner thread would import while the program serves
                preload.preload(STATE.manager_source)
        STATE.handles.append(register_module_forward_pre_hook(_pre))
        STATE.handles.append(register_module_forward_hook(_post, with_kwargs=True, always_call=True))
        # torch warns that global hooks also fire for torch.compile's wrapper module; the hooks
        # here skip that wrapper, so the warning (raised by every compiling backend) is noise
        warnings.filterwarnings("ignore", message=_COMPILE_WARNING, category=UserWarning)
        logger.debug("aitune jit: enabled")


def enabled() -> bool:
    return bool(STATE.handles)


def disable() -> None:
    """Turn JIT tuning off: remove the hooks, give tuned modules their own forward back, forget everything."""
    with STATE.lock:
        for handle in STATE.handles:
            handle.remove()
            # torch's handle forgets the hook but not its with_kwargs flag, and any flag left there
            # makes every later torch.compile in the process warn about global hooks
            getattr(torch.nn.modules.module, "_global_forward_hooks_with_kwargs", {}).pop(handle.id, None)
        STATE.handles.clear()
        for entry in [f for f in warnings.filters if f[1] is not None and f[1].pattern == _COMPILE_WARNING]:
            warnings.filters.remove(entry)  # type: ignore[attr-defined]
        for module in list(STATE.tuned):
            reset(module)
        STATE.forget()
        STATE.manager_source = None


def startup() -> preload.Preloaded | None:
    """What switching background tuning on imported before serving, and its cost (None: nothing was
    preloaded: inline mode, ``config.preload`` off, or the JIT is off)."""
    return preload.LAST


def decisions() -> list[Decision]:
    """Every decision made in this process so far, oldest first."""
    return list(STATE.decisions)


def status() -> dict[str, str]:
    """Where each module the JIT has seen stands, by name: ``recording (3 calls)``, ``tuning``,
    ``tuned: onnxruntime``, ``eager: <why>``, ``descended: <why>`` (its children are tried)."""
    out: dict[str, str] = {}
    latest = {d.name: d for d in STATE.decisions}
    for module, entry in list(STATE.modules.items()):
        name = STATE.names.get(module)
        if name is None:  # skipped: never a candidate (the log says why)
            continue
        shown = name if name not in out else f"{name}#{id(module):x}"  # two instances of one class
        if isinstance(entry, JitCandidate):
            out[shown] = f"recording ({entry.calls} calls)"
            continue
        decision = latest.get(name)
        if entry == "tuned" and decision is not None:
            out[shown] = f"tuned: {', '.join(dict.fromkeys(decision.backends)) or 'eager graphs only'}"
        elif entry in ("eager", "descended") and decision is not None:
            out[shown] = f"{entry}: {decision.reason}"
        else:
            out[shown] = str(entry)
    return out


def request_tuning() -> None:
    """Tune every module recorded so far at its next forward call (see ``tune.deferred``)."""
    with STATE.lock:
        STATE.requests += 1


def _traced_here() -> bool:
    """torch is compiling or exporting, and in this thread. The flag is the process's: while the
    background tuner traces, the program's own calls in other threads must still be counted.
    (TorchDynamo evaluates this too, inside the hooks it traces: it reads the thread-local.)"""
    return (_is_compiling() or _is_exporting()) and (getattr(STATE.local, "tuner", False) or not STATE.tuner_running)


def _pre(module: torch.nn.Module, args: Any) -> None:
    if _traced_here():
        return
    local = STATE.local
    local.depth = getattr(local, "depth", 0) + 1
    if local.depth == 1 and not recording.bypassing():
        STATE.in_flight += 1
        if STATE.tuner_running:  # a trace of the tuner's that this call must not meet (tracing.LOCK)
            tracing.LOCK.acquire()
            local.holding = True


def _post(module: torch.nn.Module, args: Any, *rest: Any) -> None:
    if _traced_here():
        return
    local = STATE.local
    depth = local.depth = max(getattr(local, "depth", 1) - 1, 0)
    if depth == 0 and not recording.bypassing():
        STATE.in_flight = max(STATE.in_flight - 1, 0)
        if getattr(local, "holding", False):
            local.holding = False
            tracing.LOCK.release()
    if len(rest) != 2 or recording.bypassing():  # forward raised (always_call), or aitune itself is running it
        return
    entry = STATE.modules.get(module)
    if entry is None:
        if depth:
            return
        entry = admit(module, type(module).__name__, 0)
    if type(entry) is JitCandidate:
        observe(module, entry, args, rest[0], rest[1])
