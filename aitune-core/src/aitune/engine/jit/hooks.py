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

from .. import recording
from .admission import admit
from .install import uninstall
from .observe import observe
from .state import STATE, Decision, JitCandidate

logger = logging.getLogger("aitune")

_is_compiling = torch.compiler.is_compiling
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)
_COMPILE_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"


def enable() -> None:
    """Turn JIT tuning on for this process (idempotent)."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    with STATE.lock:
        if STATE.handles:
            return
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
            uninstall(module)
        STATE.forget()


def decisions() -> list[Decision]:
    """Every decision made in this process so far, oldest first."""
    return list(STATE.decisions)


def request_tuning() -> None:
    """Tune every module recorded so far at its next forward call (see ``tune.deferred``)."""
    with STATE.lock:
        STATE.requests += 1


def _pre(module: torch.nn.Module, args: Any) -> None:
    if _is_compiling() or _is_exporting():
        return
    local = STATE.local
    local.depth = getattr(local, "depth", 0) + 1


def _post(module: torch.nn.Module, args: Any, *rest: Any) -> None:
    if _is_compiling() or _is_exporting():
        return
    local = STATE.local
    depth = local.depth = max(getattr(local, "depth", 1) - 1, 0)
    if len(rest) != 2 or recording.bypassing():  # forward raised (always_call), or aitune itself is running it
        return
    entry = STATE.modules.get(module)
    if entry is None:
        if depth:
            return
        entry = admit(module, type(module).__name__, 0)
    if type(entry) is JitCandidate:
        observe(module, entry, args, rest[0], rest[1])
