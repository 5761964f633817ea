"""Tuning off the calling thread: calls keep running eager until the winner is proven.

One tuner thread at a time (a daemon: process exit waits for no tuning; a build already in the
cache stays there). At exit the tuner is told to stop and is waited for, briefly, until it reaches
its next step (a timed call, a build, a validation): a daemon thread still inside a native call when
the interpreter finalizes is killed as it takes the GIL back, unwinding C++ frames that cannot be
unwound, and the process aborts ("terminate called without an active exception"). It runs the same ``tune_candidate`` as inline mode, so the candidates are
built, validated against eager on the recorded calls and profiled before anything is installed,
and the install is one attribute assignment (``module.forward``): a call already in flight
finishes on the path it started on, the next one takes the winner.

Sharing the machine: the tuner thread runs at a lower scheduling priority where the OS allows it
(Linux: ``setpriority`` on the thread), times each call only when the caller has no call of its
own in flight (waiting a bounded time for one to end), and sleeps after each timed call so that
its timing keeps to ``config.max_tuning_share`` of the wall time.

Sharing the GIL: much of tuning is pure Python (TorchDynamo's graph-break trace, ``torch.export``,
the ONNX exporter). A program's call releases the GIL around every kernel and must take it back
each time; with a Python-bound tuner thread it waits up to the interpreter's switch interval (5 ms)
each time, and a call of a dozen layers took 60-180 ms. So the switch interval is 1 ms while a
tuner runs, and while the program has a call in flight the tuner gives the GIL away for half a
millisecond every 2 ms of its own running (a profile function on the tuner thread alone,
:func:`_step_aside`), never inside a trace the program's call waits for (``aitune.tracing.LOCK``).
A C++ stretch that holds the GIL (TorchDynamo building its guards) still makes a call wait.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any

import torch

from ... import tracing
from .decide import tune_candidate
from .state import STATE, JitCandidate, TuningStopped

logger = logging.getLogger("aitune")


STEP_ASIDE_S = 0.0005
"""How long the tuner gives the GIL away at a time while the program has a call in flight."""
RUN_S = 0.002
"""How long the tuner runs between two such pauses: it keeps at least 80% of its time."""
SWITCH_INTERVAL_S = 0.001
"""The interpreter's switch interval while a tuner runs: a program thread waiting for the GIL gets it
back within this, not 5 ms."""

EXIT_WAIT_S = 10.0
"""The longest process exit waits for the tuner to reach its next step. A build may take longer; the
tuner then waits in Python (a worker process, a compiler's own threads), where stopping it is safe."""


def start(module: torch.nn.Module, cand: JitCandidate) -> None:
    """Tune ``cand`` on a tuner thread; the caller holds ``STATE.tuning``, which the thread releases."""
    prepare()
    if not STATE.exit_registered:
        atexit.register(stop_at_exit)  # runs before the interpreter finalizes, and before torch's own handlers
        STATE.exit_registered = True
    STATE.modules[module] = "tuning"
    thread = threading.Thread(target=_run, args=(module, cand), name=f"aitune-jit {cand.name}", daemon=True)
    STATE.worker = thread
    STATE.tuner_running = True
    logger.info(
        "aitune jit: tuning %s in the background after %d calls; its calls run eager until a winner is proven",
        cand.name,
        cand.calls,
    )
    thread.start()


def prepare() -> None:
    """Import TorchDynamo on the program's thread (``jit.enable()`` does, before any call): imported
    first by the tuner thread, the program's own calls could meet it half initialized."""
    import torch._dynamo  # noqa: F401


def _run(module: torch.nn.Module, cand: JitCandidate) -> None:
    STATE.local.tuner = True
    interval = sys.getswitchinterval()
    try:
        _lower_priority()
        sys.setswitchinterval(min(interval, SWITCH_INTERVAL_S))
        sys.setprofile(_step_aside)  # this thread only
        tune_candidate(module, cand)
    except TuningStopped:
        logger.info("aitune jit: the program is exiting; tuning %s stopped", cand.name)
    finally:
        sys.setprofile(None)
        sys.setswitchinterval(interval)
        STATE.tuner_running = False
        STATE.tuning.release()


_next_step_aside = 0.0


def _step_aside(frame: Any, event: str, arg: Any) -> None:
    """The tuner thread's profile function: while the program has a call in flight, give the GIL
    away for :data:`STEP_ASIDE_S` at most once every :data:`RUN_S` of the tuner's own running, so a
    program thread waiting for the GIL takes it at once and the tuner keeps most of its time."""
    global _next_step_aside
    if event != "call" or not STATE.in_flight or tracing.held_here():
        return
    now = time.perf_counter()
    if now < _next_step_aside:
        return
    time.sleep(STEP_ASIDE_S)
    _next_step_aside = time.perf_counter() + RUN_S


def stop_at_exit() -> None:
    """Stop the tuner at its next step and wait for it, so no tuner thread is in native code when the
    interpreter finalizes."""
    thread = STATE.worker
    if thread is None or not thread.is_alive():
        return
    STATE.stopping.set()
    thread.join(EXIT_WAIT_S)
    if thread.is_alive():
        logger.warning(
            "aitune jit: the background tuner did not reach its next step within %.0f s of exit (a build under way); "
            "exiting without it",
            EXIT_WAIT_S,
        )


def _lower_priority() -> None:
    """Let the caller's threads win the CPU over this one, where the OS can say so per thread."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: normal priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def wait(timeout: float | None = None) -> bool:
    """Block until background tuning under way has finished; False when ``timeout`` ran out first."""
    thread = STATE.worker
    if thread is None:
        return True
    thread.join(timeout)
    return not thread.is_alive()
