"""One replica's model run on batches of requests, every call inside the tuned batch sizes.

Requests whose tensors agree on everything but the batch size are joined, cut into calls of tuned
sizes (the last one padded by repeating its last row, the padding's answers dropped) and split
back per request. Each call is observed (``ait.observe_routes``), so every answer says which
backend served it and, when a tuned module ran eager, why. No Ray here: the deployment feeds it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

import aitune.torch as ait

from .codec import BadRequest, named_outputs
from .plan import BatchPlan, InputSpec, call_arguments

Request = dict[str, torch.Tensor]


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


@attrs.frozen
class Call:
    """One model call, for metrics: its size, its real rows, and each tuned module's route."""

    size: int
    rows: int
    routes: tuple[ait.Route, ...]


class BatchRunner:
    """Runs ``model`` on batches of checked requests (see :func:`aitune_serve_ray.codec.decode`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        plan: BatchPlan,
        specs: Mapping[str, InputSpec],
        on_call: Callable[[Call], None] = lambda call: None,
    ) -> None:
        self.model = model
        self.plan = plan
        self.specs = specs
        self.on_call = on_call

    def run(self, requests: Sequence[Request]) -> list[Answer | BadRequest]:
        """One answer per request, in order: its outputs, or what was wrong with it."""
        answers: list[Answer | BadRequest | None] = [None] * len(requests)
        groups: dict[Any, list[int]] = collections.defaultdict(list)
        for i, request in enumerate(requests):
            groups[self._shape_key(request)].append(i)
        with torch.inference_mode():
            for members in groups.values():
                for i, answer in zip(members, self._run_group([requests[i] for i in members])):
                    answers[i] = answer
        return [a for a in answers if a is not None]

    def rows(self, request: Request) -> int:
        name, tensor = next(iter(request.items()))
        return tensor.shape[self.specs[name].batch_axis]

    def _shape_key(self, request: Request) -> Any:
        """Everything but the batch size: requests with one key can share a call."""
        key = []
        for name in sorted(request):
            t, axis = request[name], self.specs[name].batch_axis
            key.append((name, t.dtype, t.shape[:axis] + t.shape[axis + 1 :]))
        return tuple(key)

    def _run_group(self, requests: list[Request]) -> list[Answer | BadRequest]:
        try:
            return self._joined(requests)
        except _ModelRefused as refused:
            if len(requests) == 1:
                if not refused.outside:  # it fits what was tuned: the server's failure, not the request's
                    raise refused.error from None
                return [refused.bad_request()]
        # one request the model cannot take must not fail the others: each one alone
        return [answer for request in requests for answer in self._run_group([request])]

    def _joined(self, requests: list[Request]) -> list[Answer | BadRequest]:
        counts = [self.rows(r) for r in requests]
        names = list(requests[0])
        joined = {n: torch.cat([r[n] for r in requests], dim=self.specs[n].batch_axis) for n in names}
        pieces: list[dict[str, torch.Tensor]] = []
        spans: list[tuple[int, int, Call]] = []  # (first row, end row, call) per model call
        start = 0
        for take, size in self.plan.chunks(sum(counts)):
            part = {n: _rows(t, self.specs[n].batch_axis, start, take, size) for n, t in joined.items()}
            outputs, call = self._call(part, take)
            pieces.append({n: o.narrow(0, 0, take) for n, o in outputs.items()})
            spans.append((start, start + take, call))
            start += take
        merged = {n: torch.cat([p[n] for p in pieces]) for n in pieces[0]}
        answers: list[Answer | BadRequest] = []
        first = 0
        for count in counts:
            calls = [c for lo, hi, c in spans if lo < first + count and first < hi]
            answers.append(
                Answer(
                    {n: o.narrow(0, first, count) for n, o in merged.items()},
                    tuple(dict.fromkeys(f"{r.module}={r.backend}" for c in calls for r in c.routes)),
                    tuple(dict.fromkeys(f"{r.module}: {r.reason}" for c in calls for r in c.routes if r.reason)),
                    tuple(c.size for c in calls),
                )
            )
            first += count
        return answers

    def _call(self, part: Request, rows: int) -> tuple[dict[str, torch.Tensor], Call]:
        size = next(iter(part.values())).shape[self.specs[next(iter(part))].batch_axis]
        with ait.observe_routes() as seen:
            try:
                args, kwargs = call_arguments(self.model, part)
                outputs = named_outputs(self.model(*args, **kwargs))
            except Exception as exc:
                raise _ModelRefused(exc, seen) from exc
        call = Call(size, rows, tuple(seen))
        self.on_call(call)
        for name, tensor in outputs.items():
            if tensor.dim() == 0 or tensor.shape[0] != size:
                raise RuntimeError(
                    f"output {name!r} has shape {tuple(tensor.shape)}: aitune-serve-ray splits a batched call's "
                    f"outputs on axis 0, which must hold the call's {size} rows"
                )
        return outputs, call


def _rows(tensor: torch.Tensor, axis: int, start: int, take: int, size: int) -> torch.Tensor:
    """Rows ``start .. start+take`` on ``axis``, padded to ``size`` rows by repeating the last one."""
    index = torch.arange(start, start + size).clamp(max=start + take - 1)
    return tensor.index_select(axis, index)


class _ModelRefused(Exception):
    """The model raised on a call; a client error when a tuned module had sent it eager (its input
    was outside what was tuned, and eager could not take it either), else the server's own."""

    def __init__(self, error: Exception, routes: Sequence[ait.Route]) -> None:
        super().__init__(str(error))
        self.error = error
        outside = [f"{r.module}: {r.reason}" for r in routes if r.reason]
        self.outside = outside

    def bad_request(self) -> BadRequest:
        first_line = str(self.error).strip().splitlines()[0] if str(self.error).strip() else ""
        return BadRequest(
            422,
            f"the model cannot take this input: {'; '.join(self.outside)}, and the model itself raised "
            f"{type(self.error).__name__}: {first_line}",
        )
