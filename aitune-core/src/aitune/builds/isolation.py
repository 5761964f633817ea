"""Isolated builds: a backend's compiler runs in a worker process, so a crash costs one candidate.

A built-in plugin on ``aitune_build``. When a backend implements ``export`` and isolation is on
for it, the user's process exports the module into a folder, a worker (``python -m
aitune.builds.worker``) builds the payload from those files alone under a time limit and a memory cap,
and the user's process loads that payload. A segfault, abort, hang or out-of-memory in the worker
becomes a :class:`WorkerBuildError` for that candidate; tuning goes on. A build-cache hit answers
first (``tryfirst``), so it skips all of this; a fresh isolated build is stored by the cache's
wrapper like any other.

Settings: ``AITUNE_ISOLATE`` = ``native`` (default: backends with ``native_build = True``),
``all`` (every backend that can export) or ``none``; ``AITUNE_BUILD_TIMEOUT_S`` (default 1800);
``AITUNE_BUILD_MEMORY_MB`` (default: three quarters of the machine's memory on CPU, no cap for
CUDA builds, whose driver reserves more address space than any cap; ``0`` means no cap).

A backend with ``retry_in_process`` (AOTInductor) whose worker failed (crash, exit or error, not
a time or memory limit) is built once more in the user's process, where it takes another path, and
validated as any build; the worker's failure stays in ``build_info``.

``local``, the default executor, runs each job in a worker process on this machine (:class:`LocalExecutor`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import envvars, hookimpl
from ..backend import EXPORT_S, WAIT_S, Backend, BuildContext, LoadContext
from ..executor import BuildHandle, BuildRequest, Executor, WorkerBuildError, run_worker, stop
from ..session import Session

logger = logging.getLogger("aitune")


def mode() -> str:
    """``AITUNE_ISOLATE``: ``native``, ``all`` or ``none``."""
    return envvars.ISOLATE.get()


def isolated(backend: Backend) -> bool:
    """Whether ``backend`` builds in a worker (when it can export) under the current setting."""
    chosen = mode()
    return chosen == "all" or (chosen == "native" and backend.native_build)


@hookimpl(specname="aitune_build")
def build_isolated(
    backend: Backend, module: torch.nn.Module, context: BuildContext, session: Session
) -> Backend | None:
    """Build in a worker when isolation applies and the backend can export; else leave it to the default.

    The run's executor (``session.builds``) runs the worker, and a build it was handed ahead is
    taken here instead of exporting again; with no run's builds, a worker process on this machine.
    """
    if not isolated(backend):
        return None
    queue = session.builds
    ahead = queue.take(backend, module, context) if queue is not None else None
    start = time.perf_counter()
    export_s = 0.0
    if ahead is not None:
        request, handle = ahead
    else:
        folder = Path(tempfile.mkdtemp(prefix="isolated-", dir=context.workdir))
        (folder / "exported").mkdir()
        notes = backend.export(module, context, folder / "exported")
        if notes is None:
            return None
        export_s = time.perf_counter() - start
        start = time.perf_counter()
        request = BuildRequest(backend, notes, context, folder)
        handle = (queue.executor if queue is not None else LocalExecutor()).submit(request)
    try:
        metadata = handle.result()
    except WorkerBuildError as exc:
        if not backend.retry_in_process or exc.cause in ("timeout", "memory"):
            raise  # a hang or a memory blow-up would do the same here, in the user's process
        return _in_process(backend, module, context, exc)
    waited_s = time.perf_counter() - start
    worker_s = handle.worker_s if handle.worker_s is not None else waited_s
    load_context = LoadContext(context.graph, context.device, metadata, context.cache_dir, context.module_name)
    loaded: Backend = session.hook.aitune_deserialize(
        backend=backend, module=module, directory=request.folder / "payload", context=load_context, session=session
    )
    # a build warms up on the recorded samples; the worker never saw them, so warm up here
    # (CUDA-graph capture, lazy runtime init), keeping the user's first call free of that cost
    with torch.no_grad():
        for sample in context.samples:
            loaded.infer(*sample.args, **sample.kwargs)
    loaded.build_info["isolated"] = True
    loaded.build_info["worker_s"] = round(worker_s, 3)
    if queue is not None and queue.executor.name != "local":
        loaded.build_info["executor"] = queue.executor.name
    if ahead is not None:
        loaded.build_info["built_ahead"] = True  # build_time_s is then the wait for it, not the build
        loaded.build_info[WAIT_S] = round(waited_s, 3)  # its export and build ran before: this is the wait
    else:
        loaded.build_info[EXPORT_S] = round(export_s, 3)
    return loaded


def _in_process(backend: Backend, module: torch.nn.Module, context: BuildContext, failure: WorkerBuildError) -> Backend:
    """Build once more in this process, where the backend takes another path than in the worker
    (``Backend.retry_in_process``); validation then judges it as any build. The worker's failure,
    its log's key lines included, stays in ``build_info`` for the report and the journal."""
    logger.warning(
        "%s: %s failed in the build worker (%s); building it in this process instead, under the same validation",
        context.module_name,
        backend.name,
        str(failure).splitlines()[0].split(";")[0],
    )
    backend.build(module, context)
    backend.build_info.update(isolated=False, retried_in_process=True, worker_failure=str(failure))
    return backend


class _Deferred(BuildHandle):
    def __init__(self, run: Callable[[], dict[str, Any]]) -> None:
        self._run = run

    def result(self) -> dict[str, Any]:
        return self._run()


class _Background(BuildHandle):
    """A build running in a worker process started from one of the executor's threads."""

    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor, request: BuildRequest) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._cancelled = False
        self.future = pool.submit(self._run, request)

    def _run(self, request: BuildRequest) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            return run_worker(request.backend, request.notes, request.context, request.folder, self._started)
        finally:
            self.worker_s = time.perf_counter() - start  # the build's own time, not the wait for it

    def _started(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        if self._cancelled:  # cancelled while the worker was starting
            stop(proc)

    def result(self) -> dict[str, Any]:
        try:
            return self.future.result()
        except BaseException:  # Ctrl-C while waiting: take the worker down with us
            self.cancel()
            raise

    def wait(self) -> None:
        concurrent.futures.wait([self.future])

    def cancel(self) -> None:
        """Drop a build not started yet; stop a running one's worker (nobody will take its result)."""
        self._cancelled = True
        if not self.future.cancel() and self._proc is not None:
            stop(self._proc)


def background_workers() -> int:
    """How many builds the local executor runs beside the user's process: ``AITUNE_BUILD_WORKERS``,
    else the cores the tune's threads leave free (2 cores at one thread: 1), at most
    :data:`MAX_BACKGROUND`; 0 builds each one when the strategy asks for it, in the foreground."""
    chosen = envvars.BUILD_WORKERS.get()
    if chosen is not None:
        return chosen
    spare = (os.cpu_count() or 1) // max(torch.get_num_threads(), 1) - 1
    return min(max(spare, 0), MAX_BACKGROUND)


MAX_BACKGROUND = 2
"""The default's cap on builds beside the tune: each compiler build takes gigabytes of memory."""


class LocalExecutor(Executor):
    """Each build in a worker process on this machine.

    With spare cores (:func:`background_workers`) the executor is ``concurrent``: every isolated
    build is exported and started right after recording, up to that many at once, while the
    tune builds the other candidates in its own process; profiling waits until they are done.
    Without, each build runs when the strategy asks for it.
    """

    name = "local"

    def __init__(self, workers: int | None = None) -> None:
        self.workers = background_workers() if workers is None else workers
        self.concurrent = self.workers > 0
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="aitune-build")
            if self.workers > 0
            else None
        )

    def submit(self, request: BuildRequest) -> BuildHandle:
        if self._pool is None:
            return _Deferred(lambda: run_worker(request.backend, request.notes, request.context, request.folder))
        return _Background(self._pool, request)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {
            "where": "worker processes on this machine",
            "CPU": os.cpu_count(),
            "GPU": torch.cuda.device_count(),
            "beside the tune": background_workers(),
        }
