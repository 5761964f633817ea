"""Request-body limits in front of kserve's REST app: a size cap enforced while the body streams
in (chunked bodies included) and a read timeout, so a client that uploads slowly, or forever,
neither holds memory nor a slot.

kserve (FastAPI under uvicorn) reads a whole body before its handler runs and has no limit of
either kind; uvicorn has none for bodies either. This ASGI middleware reads the body first, within
both limits, and hands the app what it read: a body over the cap is answered 413 as soon as the
cap is passed (what is read is dropped, the rest never is), one whose next bytes take longer than
the timeout 408, each in the protocol's error body (``{"error": ...}``) with ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 64 * 1024 * 1024
"""The default cap on one request body: a few hundred of the largest tuned batches of most models."""
READ_TIMEOUT_S = 10.0
"""The default wait for a body's next bytes: a stalled upload is dropped after this long (and at most
a tenth of it, or a second, later)."""


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class BodyLimits:
    """Reads each HTTP request's body within ``max_body_bytes`` and ``read_timeout_s``, then runs
    ``app`` on it. Requests without a body (GET) pass through untouched."""

    def __init__(self, app: App, max_body_bytes: int = MAX_BODY_BYTES, read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self._reading: dict[asyncio.Task[Any], float] = {}  # a task waiting on body bytes -> its deadline
        self._expired: set[asyncio.Task[Any]] = set()
        self._reaper: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        try:
            messages = await self._read(scope, receive)
        except _Refused as refused:
            await _answer(send, refused.status, str(refused))
            return
        replay = iter(messages)

        async def replayed() -> Message:
            message = next(replay, None)
            return message if message is not None else await receive()  # then: http.disconnect

        await self.app(scope, replayed, send)

    async def _read(self, scope: Scope, receive: Receive) -> list[Message]:
        """The body's messages, read within the cap and the timeout (raises :class:`_Refused`).

        Each wait for bytes is registered with its deadline; one timer for the whole server
        (:meth:`_reap`) cancels the waits past theirs, rather than a timer per wait: ``asyncio.timeout``
        arms and cancels one on every request. One frame for the whole read, the task and loop looked
        up once: on a served model's path every call costs more than in a loop (benchmarks/README.md,
        "the lone request's path")."""
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            raise _Refused(413, self._too_large(f"Content-Length {declared}"))
        task = asyncio.current_task()
        assert task is not None, "an ASGI app runs in a task"
        loop = task.get_loop()
        reading = self._reading
        messages: list[Message] = []
        size = 0
        while True:
            reading[task] = loop.time() + self.read_timeout_s
            if self._reaper is None or self._reaper[0] is not loop:
                self._reaper = loop, loop.call_later(self._period(), self._reap, loop)
            try:
                message = await receive()
            except asyncio.CancelledError:
                if task not in self._expired:
                    raise
                self._expired.discard(task)
                uncancel = getattr(task, "uncancel", None)  # Python 3.11+: the cancel was the reaper's
                if uncancel is not None:
                    uncancel()
                raise _Refused(
                    408,
                    f"the request body stalled: no bytes for {self.read_timeout_s:g} s after {size} bytes; "
                    f"send the whole body without pausing",
                ) from None
            finally:
                reading.pop(task, None)
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # the client went away: the app sees the disconnect
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                raise _Refused(413, self._too_large(f"more than {self.max_body_bytes} bytes"))
            if not message.get("more_body", False):
                return messages

    def _period(self) -> float:
        return min(max(self.read_timeout_s / 10, 0.01), 1.0)

    def _reap(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cancel each read past its deadline; run again while any read waits."""
        now = loop.time()
        for task, deadline in list(self._reading.items()):
            if deadline <= now and task not in self._expired:
                self._expired.add(task)
                task.cancel()
        self._reaper = (loop, loop.call_later(self._period(), self._reap, loop)) if self._reading else None

    def _too_large(self, what: str) -> str:
        return (
            f"the request body is too large ({what}); this server takes at most {self.max_body_bytes} bytes "
            f"(aitune serve --max-body-mb): send fewer rows per request, or binary tensors instead of JSON"
        )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _answer(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


ROW_ELEMENTS_SLACK = 4
"""A request's row may hold this many times the elements of the largest row the model was tuned
for: longer rows run eager (outside what was tuned), far longer ones are refused before they run."""


def row_element_caps(model: Any, inputs: Any) -> dict[str, int]:
    """Per model input (``inputs``: :func:`aitune.torch.serving.input_specs`), the most elements one
    row may hold: :data:`ROW_ELEMENTS_SLACK` times the largest row any tuned graph taking that input
    by name was tuned for. Inputs no tuned graph names have no cap here (the body cap holds them)."""
    from aitune.torch.serving import tuned_graphs

    caps: dict[str, int] = {}
    for graph in tuned_graphs(model):
        for spec in graph.inputs:
            if spec.path not in inputs:
                continue
            shape = list(graph.shape_at(spec, "max"))
            if spec.batch_axis is not None:
                del shape[spec.batch_axis]
            elements = 1
            for size in shape:
                elements *= max(size, 1)
            caps[spec.path] = max(caps.get(spec.path, 0), ROW_ELEMENTS_SLACK * elements)
    return caps
