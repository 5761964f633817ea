"""The JIT's state in the running program, gathered in one object.

The hooks, the modules seen, the decisions made and the pending ``deferred()`` requests belong to
the process, not to any one module, so they live in one :class:`JitState` instance, ``STATE``,
that every part of the JIT reads and ``disable()`` resets. Apart from the user's settings in
``config``, nothing in the JIT keeps state at module level.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import attrs
import torch

if TYPE_CHECKING:
    from ...plugins import AituneManager

from ..module import Module
from ..recording import Recording


@attrs.frozen
class Decision:
    """What the JIT did with one module; ``decisions()`` lists them in the order they were made."""

    name: str
    module_class: str
    depth: int
    outcome: str
    """``tuned``, ``eager`` (stays eager, children untouched) or ``descended`` (stays eager, children tried)."""
    backends: tuple[str, ...] = ()
    """The winner of each tuned graph."""
    from_cache: bool = False
    """Installed from a decision remembered by an earlier run, with no tuning and no build."""
    reason: str = ""


@attrs.define(eq=False)
class JitCandidate:
    """A module being recorded: its calls go to ``recording`` until it is tuned."""

    name: str
    depth: int
    twin: torch.nn.Module
    wrapper: Module
    recording: Recording
    since: int
    """``deferred()`` requests already made when recording started."""
    calls: int = 0
    warned: bool = False


Settled = Literal["skipped", "tuning", "tuned", "eager", "descended"]
ModuleState = JitCandidate | Settled
"""Where a module stands: a :class:`JitCandidate` while it records, else what became of it."""


@attrs.define(eq=False)
class JitState:
    """Everything the JIT knows in this process; one instance, ``STATE``."""

    handles: list[Any] = attrs.field(factory=list)
    """The two process-wide forward hooks while JIT tuning is on."""
    modules: weakref.WeakKeyDictionary[torch.nn.Module, ModuleState] = attrs.field(factory=weakref.WeakKeyDictionary)
    names: weakref.WeakKeyDictionary[torch.nn.Module, str] = attrs.field(factory=weakref.WeakKeyDictionary)
    """The name each candidate got (``Encoder.layers.3``), kept after it settles, for ``status()``."""
    tuned: weakref.WeakSet[torch.nn.Module] = attrs.field(factory=weakref.WeakSet)
    """Modules whose ``forward`` is a ``TunedForward``, to restore on ``disable()``."""
    decisions: list[Decision] = attrs.field(factory=list)
    requests: int = 0
    """How many times ``deferred()`` asked for tuning."""
    local: threading.local = attrs.field(factory=threading.local)
    """Per thread: ``depth``, how many module forwards the current call is nested in."""
    lock: threading.RLock = attrs.field(factory=threading.RLock)
    """Guards switching on and off and the request counter."""
    tuning: threading.Lock = attrs.field(factory=threading.Lock)
    """Held while a module is tuned: one at a time, and never re-entered from the tuning itself."""
    worker: threading.Thread | None = None
    """The tuner thread of background mode, while one runs (or the last one)."""
    tuner_running: bool = False
    """A tuner thread is at work: the program's top-level calls take the tracing lock, and the
    process-wide compiling flag may be the tuner's (the tuner thread marks itself in ``local.tuner``)."""
    in_flight: int = 0
    """Top-level module calls of the program under way now (not aitune's own): the background
    tuner times a call only when there are none, and steps aside while there are (:mod:`.background`)."""
    exit_registered: bool = False
    """``background.stop_at_exit`` is registered with atexit (once per process)."""
    stopping: threading.Event = attrs.field(factory=threading.Event)
    """Set when the process exits: the tuner thread stops at its next step (see :mod:`.background`)."""
    manager_source: Callable[[], AituneManager] | None = None
    """Gives the plugin manager the JIT tunes with (``enable()``'s, or the process's when it named
    none), from ``enable()`` until ``disable()``."""

    def forget(self) -> None:
        """Drop every module, decision and request (the hooks are the caller's business)."""
        self.tuned.clear()
        self.modules.clear()
        self.names.clear()
        self.decisions.clear()
        self.requests = 0
        self.local.depth = 0
        self.in_flight = 0


class TuningStopped(BaseException):
    """Raised in the tuner thread at its next step once the process exits. A BaseException, so no
    ``except Exception`` on the way (a candidate's failure, a module's) takes it for a failure."""


def check_stopping() -> None:
    """A point where the background tuner may stop: between steps, never inside a native call."""
    if STATE.stopping.is_set() and getattr(STATE.local, "tuner", False):
        raise TuningStopped


STATE = JitState()
