"""Requests joined into model calls inside the tuned batch sizes, without waiting for company.

kserve's ``ModelServer`` has no dynamic batcher, so aitune batches: a request that arrives while
the model is idle runs at once, alone; requests that arrive while it runs queue, and the next call
takes all of them together, up to the largest tuned batch size (counted in rows). So a lone client
pays no queue delay, and under load each call is as full as the queue allows.

A call joins requests whose tensors agree on everything but the batch size, cuts the rows into calls
of tuned sizes (the last one padded by repeating its last row, the padding's answers dropped) and
splits the outputs back per request. Each call is observed (``ait.observe_routes``), so every answer
says which backend served it and, when a tuned module ran eager, why.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

import aitune.torch as ait

from .plan import BatchPlan, InputSpec, forward_of, named_outputs

Request = dict[str, torch.Tensor]


class ClientError(ValueError):
    """What the client must change (the server answers it with a 4xx)."""


class Stopping(RuntimeError):
    """The batcher was closed: it answers what it holds and takes nothing new."""


@attrs.frozen
class Answer:
    """One request's outputs and how they were computed."""

    outputs: dict[str, torch.Tensor]
    backends: tuple[str, ...]
    """``module=backend`` for each tuned module that served the request's rows."""
    eager_reasons: tuple[str, ...]
    """Why a tuned module ran eager for these rows (outside what was tuned, ...); empty when none did."""
    batch_sizes: tuple[int, ...]
    """The size of each model call (padding included) that served the request's rows."""
    joined: int
    """How many requests the call that served this one joined (this one included)."""


class BatchRunner:
    """Runs ``model`` on batches of checked requests (synchronous: the batcher calls it in its thread)."""

    def __init__(
        self,
        model: torch.nn.Module,
        plan: BatchPlan,
        specs: Mapping[str, InputSpec],
        on_call: Callable[[int, int, Sequence[ait.Route]], None] = lambda size, rows, routes: None,
    ) -> None:
        self.model = model
        self.plan = plan
        self.specs = specs
        self.on_call = on_call
        self._signature = inspect.signature(forward_of(model))  # read once: a wrapped forward's is slow to read

    def rows(self, request: Request) -> int:
        name, tensor = next(iter(request.items()))
        return tensor.shape[self.specs[name].batch_axis]

    def run(self, requests: Sequence[Request]) -> list[Answer | ClientError]:
        """One answer per request, in order: its outputs, or what was wrong with it."""
        answers: list[Answer | ClientError | None] = [None] * len(requests)
        groups: dict[Any, list[int]] = collections.defaultdict(list)
        for i, request in enumerate(requests):
            groups[self._shape_key(request)].append(i)
        with torch.inference_mode():
            for members in groups.values():
                for i, answer in zip(members, self._run_group([requests[i] for i in members])):
                    answers[i] = answer
        return [a for a in answers if a is not None]

    def _shape_key(self, request: Request) -> Any:
        """Everything but the batch size: requests with one key can share a call."""
        key = []
        for name in sorted(request):
            t, axis = request[name], self.specs[name].batch_axis
            key.append((name, t.dtype, t.shape[:axis] + t.shape[axis + 1 :]))
        return tuple(key)

    def _run_group(self, requests: list[Request]) -> list[Answer | ClientError]:
        try:
            return self._joined(requests)
        except _ModelRefused as refused:
            if len(requests) == 1:
                if not refused.outside:  # it fits what was tuned: the server's failure, not the request's
                    raise refused.error from None
                return [refused.client_error()]
        # one request the model cannot take must not fail the others: each one alone
        return [answer for request in requests for answer in self._run_group([request])]

    def _joined(self, requests: list[Request]) -> list[Answer | ClientError]:
        counts = [self.rows(r) for r in requests]
        names = list(requests[0])
        if len(requests) == 1:
            joined = requests[0]
        else:
            joined = {n: torch.cat([r[n] for r in requests], dim=self.specs[n].batch_axis) for n in names}
        pieces: list[dict[str, torch.Tensor]] = []
        spans: list[tuple[int, int, int, tuple[ait.Route, ...]]] = []  # (first row, end row, size, routes)
        start = 0
        for take, size in self.plan.chunks(sum(counts)):
            part = {n: _rows(t, self.specs[n].batch_axis, start, take, size) for n, t in joined.items()}
            outputs, routes = self._call(part, size, take)
            pieces.append({n: o.narrow(0, 0, take) for n, o in outputs.items()})
            spans.append((start, start + take, size, routes))
            start += take
        merged = pieces[0] if len(pieces) == 1 else {n: torch.cat([p[n] for p in pieces]) for n in pieces[0]}
        answers: list[Answer | ClientError] = []
        first = 0
        for count in counts:
            calls = [(size, routes) for lo, hi, size, routes in spans if lo < first + count and first < hi]
            answers.append(
                Answer(
                    {n: o.narrow(0, first, count) for n, o in merged.items()},
                    tuple(dict.fromkeys(f"{r.module}={r.backend}" for _, rs in calls for r in rs)),
                    tuple(dict.fromkeys(f"{r.module}: {r.reason}" for _, rs in calls for r in rs if r.reason)),
                    tuple(size for size, _ in calls),
                    len(requests),
                )
            )
            first += count
        return answers

    def _call(self, part: Request, size: int, rows: int) -> tuple[dict[str, torch.Tensor], tuple[ait.Route, ...]]:
        with ait.observe_routes() as seen:
            try:
                bound = self._signature.bind(**part)
                args, kwargs = bound.args, bound.kwargs
                outputs = named_outputs(self.model(*args, **kwargs))
            except Exception as exc:
                raise _ModelRefused(exc, seen) from exc
        routes = tuple(seen)
        self.on_call(size, rows, routes)
        for name, tensor in outputs.items():
            if tensor.dim() == 0 or tensor.shape[0] != size:
                raise RuntimeError(
                    f"output {name!r} has shape {tuple(tensor.shape)}: aitune-serve-kserve splits a batched "
                    f"call's outputs on axis 0, which must hold the call's {size} rows"
                )
        return outputs, routes


def _rows(tensor: torch.Tensor, axis: int, start: int, take: int, size: int) -> torch.Tensor:
    """Rows ``start .. start+take`` on ``axis``, padded to ``size`` rows by repeating the last one."""
    if size == take and start == 0 and tensor.shape[axis] == take:
        return tensor
    index = torch.arange(start, start + size).clamp(max=start + take - 1)
    return tensor.index_select(axis, index)


class _ModelRefused(Exception):
    """The model raised on a call; a client error when a tuned module had sent it eager (its input
    was outside what was tuned, and eager could not take it either), else the server's own."""

    def __init__(self, error: Exception, routes: Sequence[ait.Route]) -> None:
        super().__init__(str(error))
        self.error = error
        self.outside = [f"{r.module}: {r.reason}" for r in routes if r.reason]

    def client_error(self) -> ClientError:
        first_line = str(self.error).strip().splitlines()[0] if str(self.error).strip() else ""
        return ClientError(
            f"the model cannot take this input: {'; '.join(self.outside)}, and the model itself raised "
            f"{type(self.error).__name__}: {first_line}"
        )


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
