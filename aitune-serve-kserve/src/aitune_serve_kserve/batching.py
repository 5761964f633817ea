"""Requests joined into model calls inside the tuned batch sizes, without waiting for company.

kserve's ``ModelServer`` has no dynamic batcher, so aitune batches: a request that arrives while
the model is idle runs at once, alone; requests that arrive while it runs queue, and the next call
takes all of them together, up to the largest tuned batch size (counted in rows). So a lone client
pays no queue delay, and under load each call is as full as the queue allows.

Calls run in a thread of their own, so the event loop keeps reading requests while the model runs.
A request that is alone (no other request submitted with it, none queued, no call running) and
whose model answers quickly (the last call took under :data:`INLINE_MAX_S`) runs on the event loop
itself instead: nobody waits on the loop meanwhile, and it saves the two thread hops and the GIL
handover that are a third of a small model's time per request on a lone client. Requests that
arrive together still reach the queue together: each yields to the loop once before it decides,
unless the server can tell that no other request is in progress (:attr:`Batcher.company`).

What one call does with the requests it takes (joined, cut into calls of tuned sizes, padded, split
back, each call observed) is every engine's: :class:`aitune.torch.serving.BatchRunner`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from aitune.torch.serving import Answer, BatchRunner, ClientError, Request

INLINE_MAX_S = 0.02
"""A lone request runs on the event loop only while model calls take less than this (a slower model
would keep the loop from reading new requests for longer than the hop it saves is worth)."""


HEALTH_CALL_AFTER_S = 10.0
"""A health check runs a model call (the warm-up's, on a tuned route) when no call returned for this
long; while requests are answered, that is the proof of health, and a check costs nothing."""


def request_company(rest_server: Any, grpc: bool) -> Callable[[], bool] | None:
    """For :attr:`Batcher.company`: whether more than one request is in progress, read from uvicorn's
    set of request tasks (``uvicorn.Server.server_state.tasks``, of the server kserve's ``RESTServer``
    keeps as ``_server``; a task joins it when a request's headers are read, before it runs). None
    where that set cannot be read, or with gRPC on: gRPC requests are not in it."""
    uvicorn_server = getattr(rest_server, "_server", None)
    tasks = getattr(getattr(uvicorn_server, "server_state", None), "tasks", None)
    if grpc or not isinstance(tasks, set):
        return None
    return lambda: len(tasks) > 1


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
        self.last_call_ok = 0.0
        """``time.monotonic()`` when a model call last returned (answers or client errors, not a failure)."""
        self._submitted = 0  # requests inside submit()
        self._running = False  # a call is running in the model's thread
        self._last_call_s = 0.0
        self.unhealthy_reason = ""
        self.failure: str | None = None
        """Why the last health call failed; None once any call succeeds."""
        self._probing = False
        self._probe_task: asyncio.Task[None] | None = None
        self.company: Callable[[], bool] | None = None
        """Whether a request other than the one deciding is in progress anywhere in the server (so it
        might join), where the server can tell; None: always assume so. A request with no company
        skips the yield to the loop that lets others reach :meth:`submit`, about 20 µs."""
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="aitune-model", initializer=setup_thread
        )

    async def submit(self, request: Request) -> Answer:
        """This request's answer, computed in the next model call (raises :class:`ClientError`)."""
        if self._closing:
            raise Stopping("the server is stopping")
        self._submitted += 1
        try:
            company = self.company
            if company is None or company():
                await asyncio.sleep(0)  # the requests that came with this one reach submit() before it decides
            if self._submitted == 1 and not self._queue and not self._running and self._last_call_s < INLINE_MAX_S:
                answer = self._inline(request)
            else:
                answer = await self._queued(request)
        finally:
            self._submitted -= 1
        if isinstance(answer, ClientError):
            raise answer
        return answer

    def _inline(self, request: Request) -> Answer | ClientError:
        """A lone request's call, on the event loop's thread (see the module's docstring)."""
        self.on_batch(1)
        started = time.perf_counter()
        [answer] = self.runner.run([request])  # raising: the server's own failure, this request's alone
        self._last_call_s = time.perf_counter() - started
        self._answered()
        return answer

    async def _queued(self, request: Request) -> Answer | ClientError:
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._wake = asyncio.Event()
            self._worker = loop.create_task(self._work())
        waiting = _Waiting(request, self.runner.rows(request), loop.create_future())
        self._queue.append(waiting)
        assert self._wake is not None
        self._wake.set()
        return await waiting.future

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
            self._running = True
            started = time.perf_counter()
            try:
                answers = await loop.run_in_executor(self._thread, self.runner.run, [w.request for w in batch])
            except Exception as exc:  # the server's own failure: every request of the call gets it
                for waiting in batch:
                    if not waiting.future.done():
                        waiting.future.set_exception(exc)
                continue
            finally:
                self._running = False
            self._last_call_s = time.perf_counter() - started
            self._answered()
            for waiting, answer in zip(batch, answers):
                if not waiting.future.done():  # a client that went away cancelled its future
                    waiting.future.set_result(answer)
        self._thread.shutdown(wait=False)

    @property
    def closing(self) -> bool:
        return self._closing

    def healthy(self, probe: Request | None) -> bool:
        """Not stopping, and the last health call (if any) did not fail; :attr:`unhealthy_reason` says
        why not. Cheap, as it must be: kserve asks it before every request. When no model call returned
        for :data:`HEALTH_CALL_AFTER_S`, ``probe`` (a request the model answered at start-up) is sent in
        the background, and its failure reads here until a call succeeds again."""
        if self._closing:
            self.unhealthy_reason = "the server is stopping"
            return False
        if probe is not None and not self._probing and time.monotonic() - self.last_call_ok >= HEALTH_CALL_AFTER_S:
            self._probing = True
            self._probe_task = asyncio.get_running_loop().create_task(self._probe(probe))
        return self.failure is None

    async def _probe(self, probe: Request) -> None:
        try:
            await self.submit(probe)
        except Exception as exc:
            self.failure = self.unhealthy_reason = f"the health call failed ({type(exc).__name__}: {exc})"
        finally:
            self._probing = False

    def _answered(self) -> None:
        """A model call returned: the model is healthy."""
        self.last_call_ok = time.monotonic()
        self.failure = None

    def run_now(self, requests: Sequence[Request]) -> list[Answer | ClientError]:
        """Requests run in the model's thread, blocking (the warm-up before the server is ready); timed,
        so a model slower than :data:`INLINE_MAX_S` never runs a request on the event loop."""
        started = time.perf_counter()
        answers = self._thread.submit(self.runner.run, list(requests)).result()
        self._last_call_s = time.perf_counter() - started
        return answers

    def close(self) -> None:
        """Take nothing new; what is queued or running is still answered (kserve unloads the model when
        it starts stopping, while its gRPC server still drains), then the model's thread ends."""
        self._closing = True
        if self._worker is None or self._worker.done():
            self._thread.shutdown(wait=False)
        elif self._wake is not None:
            self._wake.set()
