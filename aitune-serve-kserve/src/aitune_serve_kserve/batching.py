"""Requests joined into model calls inside the tuned batch sizes, without waiting for company.

kserve's ``ModelServer`` has no dynamic batcher, so aitune batches: a request that arrives while
the model is idle runs at once, alone; requests that arrive while it runs queue, and the next call
takes all of them together, up to the largest tuned batch size (counted in rows). So a lone client
pays no queue delay, and under load each call is as full as the queue allows.

What one call does with the requests it takes (joined, cut into calls of tuned sizes, padded, split
back, each call observed) is every engine's: :class:`aitune.torch.serving.BatchRunner`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Callable, Sequence

import attrs

from aitune.torch.serving import Answer, BatchRunner, ClientError, Request


class Stopping(RuntimeError):
    """The batcher was closed: it answers what it holds and takes nothing new."""


@attrs.define
class _Waiting:
    request: Request
    rows: int
    future: asyncio.Future[Answer | ClientError]


class Batcher:
    """The asyncio side: requests queue here and one worker feeds them to a :class:`BatchRunner` in one
    thread of its own (torch's intra-op threads do the parallel work; calls never overlap)."""

    def __init__(
        self,
        runner: BatchRunner,
        setup_thread: Callable[[], None] = lambda: None,
        on_batch: Callable[[int], None] = lambda requests: None,
    ) -> None:
        self.runner = runner
        self.on_batch = on_batch
        self._queue: collections.deque[_Waiting] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._closing = False
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="aitune-model", initializer=setup_thread
        )

    async def submit(self, request: Request) -> Answer:
        """This request's answer, computed in the next model call (raises :class:`ClientError`)."""
        if self._closing:
            raise Stopping("the server is stopping")
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._wake = asyncio.Event()
            self._worker = loop.create_task(self._work())
        waiting = _Waiting(request, self.runner.rows(request), loop.create_future())
        self._queue.append(waiting)
        assert self._wake is not None
        self._wake.set()
        answer = await waiting.future
        if isinstance(answer, ClientError):
            raise answer
        return answer

    def _take(self) -> list[_Waiting]:
        """What queued, oldest first, up to the largest tuned batch size in rows (at least one request)."""
        limit = self.runner.plan.max_batch_size
        taken = [self._queue.popleft()]
        rows = taken[0].rows
        while self._queue and rows + self._queue[0].rows <= limit:
            rows += self._queue[0].rows
            taken.append(self._queue.popleft())
        return taken

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        while True:
            if not self._queue:
                if self._closing:
                    break
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._take()
            self.on_batch(len(batch))
            try:
                answers = await loop.run_in_executor(self._thread, self.runner.run, [w.request for w in batch])
            except Exception as exc:  # the server's own failure: every request of the call gets it
                for waiting in batch:
                    if not waiting.future.done():
                        waiting.future.set_exception(exc)
                continue
            for waiting, answer in zip(batch, answers):
                if not waiting.future.done():  # a client that went away cancelled its future
                    waiting.future.set_result(answer)
        self._thread.shutdown(wait=False)

    def run_now(self, requests: Sequence[Request]) -> list[Answer | ClientError]:
        """Requests run in the model's thread, blocking (the warm-up before the server is ready)."""
        return self._thread.submit(self.runner.run, list(requests)).result()

    def close(self) -> None:
        """Take nothing new; what is queued or running is still answered (kserve unloads the model when
        it starts stopping, while its gRPC server still drains), then the model's thread ends."""
        self._closing = True
        if self._worker is None or self._worker.done():
            self._thread.shutdown(wait=False)
        elif self._wake is not None:
            self._wake.set()
