"""Isolated builds: a backend's compiler runs in a worker process, so a crash costs one candidate.

A built-in plugin on ``aitune_build``. When a backend implements ``export`` and isolation is on
for it, the user's process exports the module into a folder, a worker (``python -m
aitune.worker``) builds the payload from those files alone under a time limit and a memory cap,
and the user's process loads that payload. A segfault, abort, hang or out-of-memory in the worker
becomes a :class:`WorkerBuildError` for that candidate; tuning goes on. A build-cache hit answers
first (``tryfirst``), so it skips all of this; a fresh isolated build is stored by the cache's
wrapper like any other.

Settings: ``AITUNE_ISOLATE`` = ``native`` (default: backends with ``native_build = True``),
``all`` (every backend that can export) or ``none``; ``AITUNE_BUILD_TIMEOUT_S`` (default 1800);
``AITUNE_BUILD_MEMORY_MB`` (default: three quarters of the machine's memory on CPU, no cap for
CUDA builds, whose driver reserves more address space than any cap; ``0`` means no cap).

The plugin is an :class:`Isolation` object, made by the plugin manager with its hook relay.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from .. import hookimpl
from ..backend import Backend, BuildContext, LoadContext
from ..converter import unstructure
from ..errors import BuildError, ConfigError
from ..worker import EXIT_BAD_JOB, EXIT_OUT_OF_MEMORY

logger = logging.getLogger("aitune")

MODES = ("native", "all", "none")
DEFAULT_TIMEOUT_S = 1800.0
LOG_LINES = 20


class WorkerBuildError(BuildError):
    """An isolated build failed; ``cause`` is ``crash``, ``timeout``, ``memory``, ``exit`` or ``error``."""

    def __init__(self, message: str, cause: str, exit_code: int | None = None, log_tail: str = "") -> None:
        super().__init__(message)
        self.cause = cause
        self.exit_code = exit_code
        self.log_tail = log_tail


def mode() -> str:
    value = os.environ.get("AITUNE_ISOLATE", "native").strip().lower() or "native"
    if value not in MODES:
        raise ConfigError(
            f"AITUNE_ISOLATE={value!r} is not one of {', '.join(MODES)}; unset it for the default (native)"
        )
    return value


def isolated(backend: Backend) -> bool:
    """Whether ``backend`` builds in a worker (when it can export) under the current setting."""
    chosen = mode()
    return chosen == "all" or (chosen == "native" and backend.native_build)


def timeout_s() -> float:
    return _positive("AITUNE_BUILD_TIMEOUT_S", DEFAULT_TIMEOUT_S) or DEFAULT_TIMEOUT_S


def memory_mb(device: torch.device) -> int | None:
    """The worker's address-space cap in MB, or None for no cap."""
    default = None
    if device.type == "cpu":
        try:
            default = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 3 // 4 // (1024 * 1024)
        except (ValueError, OSError, AttributeError):
            default = None
    value = _positive("AITUNE_BUILD_MEMORY_MB", default)
    return int(value) if value else None


def _positive(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ConfigError(f"{name}={raw!r} must be a number >= 0")
    return value


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


class Isolation:
    """Worker builds as a plugin, handed the hook relay of its manager (to load the payload)."""

    def __init__(self, hook: Any) -> None:
        self.hook = hook

    @hookimpl(specname="aitune_build")
    def build_isolated(self, backend: Backend, module: torch.nn.Module, context: BuildContext) -> Backend | None:
        """Build in a worker when isolation applies and the backend can export; else leave it to the default.

        The tune's executor runs the worker (:mod:`aitune.builtin.executor`); a build it was handed ahead is
        taken here instead of exporting again.
        """
        if not isolated(backend):
            return None
        from ..executor import BuildRequest
        from .executor import active

        session = active()
        ahead = session.take(backend, module, context)
        start = time.perf_counter()
        if ahead is not None:
            request, handle = ahead
        else:
            folder = Path(tempfile.mkdtemp(prefix="isolated-", dir=context.workdir))
            (folder / "exported").mkdir()
            notes = backend.export(module, context, folder / "exported")
            if notes is None:
                return None
            start = time.perf_counter()
            request = BuildRequest(backend, notes, context, folder)
            handle = session.executor.submit(request)
        metadata = handle.result()
        worker_s = handle.worker_s if handle.worker_s is not None else time.perf_counter() - start
        load_context = LoadContext(context.graph, context.device, metadata, context.cache_dir, context.module_name)
        loaded: Backend = self.hook.aitune_deserialize(
            backend=backend, module=module, directory=request.folder / "payload", context=load_context
        )
        # a build warms up on the recorded samples; the worker never saw them, so warm up here
        # (CUDA-graph capture, lazy runtime init), keeping the user's first call free of that cost
        with torch.no_grad():
            for sample in context.samples:
                loaded.infer(*sample.args, **sample.kwargs)
        loaded.build_info["isolated"] = True
        loaded.build_info["worker_s"] = round(worker_s, 3)
        if session.executor.name != "local":
            loaded.build_info["executor"] = session.executor.name
        if ahead is not None:
            loaded.build_info["built_ahead"] = True  # build_time_s is then the wait for it, not the build
        return loaded


def worker_job(backend: Backend, notes: dict[str, Any], context: BuildContext, folder: Path) -> dict[str, Any]:
    """The JSON a worker builds from: names, config, graph and folders, never a pickled object."""
    return {
        "backend": backend.name,
        "backend_class": _class_path(type(backend)),
        "config": unstructure(backend.config),
        "graph": unstructure(context.graph),
        "device": str(context.device),
        "notes": notes,
        "cache_dir": str(context.cache_dir),
        "module_name": context.module_name,
        "memory_mb": memory_mb(context.device),
        "timeout_s": timeout_s(),
        "what": f"{backend.name} build of {context.module_name or 'the module'} in a worker process",
        **folders(folder),
    }


def folders(folder: Path) -> dict[str, str]:
    """The job's paths inside ``folder``: another machine rewrites them for its own copy."""
    return {
        "exported": str(folder / "exported"),
        "payload": str(folder / "payload"),
        "workdir": str(folder),
        "result": str(folder / "result.json"),
    }


def run_worker(backend: Backend, notes: dict[str, Any], context: BuildContext, folder: Path) -> dict[str, Any]:
    """Run ``build_exported`` for ``backend`` in a worker; returns the payload's metadata or raises."""
    return run_job(worker_job(backend, notes, context, folder), folder)


def run_job(job: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Run one job (see :func:`worker_job`) in ``python -m aitune.worker`` under its time limit."""
    limit, cap, what = float(job["timeout_s"]), job.get("memory_mb"), job["what"]
    result, log = Path(job["result"]), folder / "worker.log"
    job_path = folder / "job.json"
    job_path.write_text(json.dumps({**job, "parent_pid": os.getpid()}, default=str))
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aitune.worker", str(job_path)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout stops the worker and its children
        )
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise WorkerBuildError(
                f"{what} did not finish within {limit:g} s and was stopped; if the build is only slow, raise "
                f"AITUNE_BUILD_TIMEOUT_S{_tail_text(log)}",
                "timeout",
                None,
                _tail(log),
            ) from None
        except BaseException:  # Ctrl-C while waiting: take the worker down with us
            _stop(proc)
            raise
    return _outcome(what, code, result, log, cap)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _outcome(what: str, code: int, result: Path, log: Path, cap: int | None) -> dict[str, Any]:
    tail = _tail(log)
    answer: dict[str, Any] = {}
    if result.is_file():
        try:
            answer = json.loads(result.read_text())
        except ValueError:
            answer = {}
    if code == 0 and answer.get("ok"):
        return dict(answer.get("metadata") or {})
    cap_text = f"{cap} MB" if cap else "none"
    if code == EXIT_OUT_OF_MEMORY or _says_out_of_memory(answer, tail):
        raise WorkerBuildError(
            f"{what} ran out of memory (address-space cap {cap_text}, AITUNE_BUILD_MEMORY_MB); raise the cap, "
            f"free memory, or build with a smaller max batch{_tail_text(log)}",
            "memory",
            code,
            tail,
        )
    if code < 0:
        name = _signal_name(-code)
        hint = " (the kernel's out-of-memory killer sends this too)" if -code == signal.SIGKILL else ""
        raise WorkerBuildError(
            f"{what} crashed with {name}{hint}; the candidate is skipped and your process is unharmed. "
            f"Report it to the backend's authors with the log{_tail_text(log)}",
            "crash",
            code,
            tail,
        )
    if answer.get("ok") is False:
        raise WorkerBuildError(
            f"{what} failed: {answer.get('error')}: {answer.get('message')}{_tail_text(log)}", "error", code, tail
        )
    why = "could not read its job" if code == EXIT_BAD_JOB else "exited without a result"
    raise WorkerBuildError(f"{what} {why} (exit code {code}){_tail_text(log)}", "exit", code, tail)


def _says_out_of_memory(answer: dict[str, Any], tail: str) -> bool:
    text = f"{answer.get('error', '')} {answer.get('message', '')}".lower()
    return answer.get("error") == "MemoryError" or "can't allocate memory" in text or "out of memory" in text


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _tail(log: Path) -> str:
    try:
        with open(log, errors="replace") as f:
            return "".join(deque(f, maxlen=LOG_LINES)).rstrip()
    except OSError:
        return ""


def _tail_text(log: Path) -> str:
    tail = _tail(log)
    return f"\nlast lines of the worker's log:\n{tail}" if tail else ""
