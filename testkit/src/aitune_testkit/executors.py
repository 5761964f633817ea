"""A concurrent executor for tests: worker processes on this machine, several at a time.

It behaves as a cluster executor does (``concurrent = True``: every build of a pipeline is
submitted right after recording, the strategies take the results later) without a cluster, so
the fan-out path can be tested anywhere. Register it with ``register_plugin(aitune_testkit.executors)``
and tune with ``executor="threads"``.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from aitune import hookimpl
from aitune.executor import BuildHandle, BuildRequest, Executor, ExecutorRegistry, ExecutorSpec


class _Future(BuildHandle):
    future: concurrent.futures.Future[dict[str, Any]]

    def result(self) -> dict[str, Any]:
        return self.future.result()

    def wait(self) -> None:
        concurrent.futures.wait([self.future])

    def cancel(self) -> None:
        self.future.cancel()


class ThreadedExecutor(Executor):
    """Each build in a worker process, two at a time, started as soon as it is submitted."""

    name = "threads"
    concurrent = True

    def __init__(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="aitune-build")
        self.submitted: list[str] = []

    def submit(self, request: BuildRequest) -> BuildHandle:
        from aitune.builds import isolation

        self.submitted.append(request.what)
        handle = _Future()

        def run() -> dict[str, Any]:
            start = time.perf_counter()
            try:
                return isolation.run_worker(request.backend, request.notes, request.context, request.folder)
            finally:
                handle.worker_s = time.perf_counter() - start

        handle.future = self.pool.submit(run)
        return handle

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"where": "worker processes on this machine, 2 at a time"}

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@hookimpl
def aitune_register_executors(registry: ExecutorRegistry) -> None:
    registry.add(ExecutorSpec(name="threads", executor_class=f"{__name__}:ThreadedExecutor"))
