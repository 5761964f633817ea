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

import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import hookimpl
from ..backend import Backend, BuildContext, LoadContext
from ..errors import ConfigError
from ..executor import BuildHandle, BuildRequest, Executor, WorkerBuildError, run_worker
from ..session import Session

logger = logging.getLogger("aitune")

MODES = ("native", "all", "none")


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
        handle = (queue.executor if queue is not None else LocalExecutor()).submit(request)
    try:
        metadata = handle.result()
    except WorkerBuildError as exc:
        if not backend.retry_in_process or exc.cause in ("timeout", "memory"):
            raise  # a hang or a memory blow-up would do the same here, in the user's process
        return _in_process(backend, module, context, exc)
    worker_s = handle.worker_s if handle.worker_s is not None else time.perf_counter() - start
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


class LocalExecutor(Executor):
    """Each build in a worker process on this machine, when the strategy asks for it."""

    name = "local"

    def submit(self, request: BuildRequest) -> BuildHandle:
        return _Deferred(lambda: run_worker(request.backend, request.notes, request.context, request.folder))

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"where": "worker processes on this machine", "CPU": os.cpu_count(), "GPU": torch.cuda.device_count()}
