"""Tracing the user's module without catching, or stopping, another thread's calls.

``torch.export`` (non-strict, its default) and FX tracing change process-wide state while they
trace: ``torch.nn.Module.__call__`` and ``__getattr__`` are replaced (``torch.fx``'s
``_Patcher``), and the traced module's parameters are swapped for fake tensors in place. A module
called from another thread at that moment would go through the tracer and compute with fake
weights. Backends hold :func:`exclusive` around such a trace (core's ONNX export, AOTInductor,
Torch-TensorRT do).

``exclusive(module)`` yields a copy of ``module`` to trace instead (:func:`detached`: new module
objects, the same parameter and buffer tensors), and makes the two method patches act in the
tracing thread alone (:func:`_this_thread_only`): the program's own calls in other threads (the
JIT's serving thread while its background tuner exports) then run as if nothing traced, and never
wait for the trace. Where either cannot be had (a module that does not deep-copy, a torch without
that patcher), and for ``exclusive()`` with no module, the trace holds :data:`LOCK`, which JIT
background mode holds around each of the program's top-level calls: a call waits for at most one
such trace.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .tracer_output import captured

LOCK = threading.RLock()
"""Held by a trace that other threads' calls must wait for, and by those calls (JIT background mode)."""
_TRACES = threading.RLock()
"""One trace at a time in the process: FX's patches of one would wrap another's."""
_HELD = threading.local()
_METHODS = ("__call__", "__getattr__")


def _patcher() -> Any:
    """torch.fx's patcher class, whose ``patch_method`` installs the tracing methods; None without one."""
    try:
        from torch.fx import _symbolic_trace
    except ImportError:
        return None
    patcher = getattr(_symbolic_trace, "_Patcher", None)
    return patcher if callable(getattr(patcher, "patch_method", None)) else None


@contextlib.contextmanager
def exclusive(module: Any = None) -> Iterator[Any]:
    """Hold while tracing the user's module (``torch.export.export``, ``torch.onnx.export``, FX).

    With ``module``, yields what to trace: a detached copy other threads never see traced, or, where
    none can be made, ``module`` itself under :data:`LOCK`. Without, yields None under :data:`LOCK`.
    What the block prints (``torch.export``'s dump of a failed trace) goes to aitune's log at DEBUG
    (:mod:`aitune.tracer_output`).
    """
    traced = detached(module) if module is not None else None
    with _TRACES, captured(f"tracing {_name(module)}"):
        if traced is not None and _patcher() is not None:
            with _tracing_thread_only():
                yield traced
            return
        with LOCK:
            _HELD.depth = getattr(_HELD, "depth", 0) + 1
            try:
                yield module
            finally:
                _HELD.depth -= 1


def _name(module: Any) -> str:
    """The user's module's class, behind the wrapper that flattens its inputs."""
    inner = getattr(module, "module", module)
    return type(inner).__name__ if inner is not None else "a module"


def held_here() -> bool:
    """This thread holds :data:`LOCK` for a trace (another thread's call may be waiting for it)."""
    return getattr(_HELD, "depth", 0) > 0


def detached(module: Any) -> Any:
    """A deep copy of ``module`` that shares its parameter and buffer tensors (no weight is copied),
    or None when it cannot be copied (an attribute that refuses ``copy.deepcopy``)."""
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    try:
        return copy.deepcopy(module, shared)
    except Exception:  # a lock, a generator, an open file: trace the module itself, under the lock
        return None


@contextlib.contextmanager
def _tracing_thread_only() -> Iterator[None]:
    """While the block runs, module-method patches made by torch.fx act in this thread alone."""
    import torch

    patcher = _patcher()
    original = patcher.patch_method
    owner = threading.get_ident()

    def patch_method(self: Any, cls: type, name: str, new_fn: Callable[..., Any], deduplicate: bool = True) -> Any:
        if cls is torch.nn.Module and name in _METHODS:
            new_fn = _this_thread_only(new_fn, getattr(cls, name), owner)
        return original(self, cls, name, new_fn, deduplicate)

    patcher.patch_method = patch_method
    try:
        yield
    finally:
        patcher.patch_method = original


def _this_thread_only(tracing: Callable[..., Any], before: Callable[..., Any], owner: int) -> Callable[..., Any]:
    """``tracing`` in the thread ``owner``, ``before`` (the method as it was) in every other thread."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == owner:
            return tracing(self, *args, **kwargs)
        return before(self, *args, **kwargs)

    return method
