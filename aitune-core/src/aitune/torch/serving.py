"""What every serving engine of ``aitune serve`` shares: a loaded artifact's inputs and batch sizes,
and running the tuned model on batches of requests inside those sizes.

The engines (``aitune-serve-kserve`` on one machine, ``aitune-serve-ray`` on a cluster) differ in
their server, protocol and queue, not in what the artifact says about serving it, so that lives once,
here, and each engine keeps only its own side:

- :class:`BatchPlan`: the batch sizes every tuned module covers (its tuned graphs, as ``ait.load``
  installed them from the manifest), and how a call's rows are cut into calls of those sizes: split
  above the largest, padded up to the smallest (or the next range above a gap);
- :func:`input_specs` and :func:`model_graph`: the forward's named inputs, typed and shaped by the
  first tuned graph whose tensors are exactly them, so a request is checked before it joins a batch;
- :class:`BatchRunner`: requests that agree on everything but the batch size joined, cut into calls
  of tuned sizes (the last one padded by repeating its last row, the padding's answers dropped) and
  split back per request; each call observed (:func:`observe_routes`), so every answer says which
  backend served it and why a tuned module ran eager; a request the model cannot take fails alone;
- :func:`named_outputs`, :func:`resolve_factory`, :func:`tuned_threads`: outputs as named tensors,
  the user's model factory, the torch threads the artifact was tuned with.

No server, protocol or numpy here: importing this module is as light as ``import aitune.torch``.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import json
import os
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from ..engine.dispatch import Route, observe_routes
from ..engine.module import Module

__all__ = [
    "Answer",
    "BatchPlan",
    "BatchRunner",
    "Call",
    "ClientError",
    "Factory",
    "InputSpec",
    "Ranges",
    "Request",
    "forward_of",
    "input_specs",
    "intersect",
    "merge",
    "model_graph",
    "named_outputs",
    "resolve_factory",
    "tuned_modules",
    "tuned_threads",
]

Factory = Callable[[], torch.nn.Module]
Request = dict[str, torch.Tensor]
Ranges = tuple[tuple[int, int], ...]
"""Sorted, disjoint, inclusive batch-size ranges."""
MAX_MANIFEST_BYTES = 64 * 1024 * 1024


# -- what the artifact says: batch sizes and inputs --------------------------------------------------------


@attrs.frozen
class BatchPlan:
    """The batch sizes every tuned module of the model covers, and how to cut rows into calls."""

    ranges: Ranges
    """Empty when no tuned module has a batch axis: each request is then one call, as sent."""

    @property
    def max_batch_size(self) -> int:
        return self.ranges[-1][1] if self.ranges else 1

    def chunks(self, rows: int) -> list[tuple[int, int]]:
        """``rows`` cut into calls, each ``(real rows, rows after padding)`` with the padded size tuned."""
        if not self.ranges:
            return [(rows, rows)]
        out = []
        while rows > 0:
            take = min(rows, self.max_batch_size)
            out.append((take, self.padded(take)))
            rows -= take
        return out

    def padded(self, rows: int) -> int:
        """The smallest tuned batch size of at least ``rows`` (``rows`` itself above every range)."""
        for low, high in self.ranges:
            if rows <= high:
                return max(rows, low)
        return rows

    @classmethod
    def of(cls, model: torch.nn.Module) -> BatchPlan:
        """The batch sizes that every tuned module of ``model`` has a route for (winner or eager)."""
        covered: Ranges | None = None
        for module in tuned_modules(model):
            mine = merge((g.batch.min, g.batch.max) for g, _ in module.tuned_graphs if g.batch is not None)
            if mine:
                covered = mine if covered is None else intersect(covered, mine)
        return cls(covered or ())


def tuned_modules(model: torch.nn.Module) -> list[Module]:
    """The tuned ``ait.Module``s in ``model`` (the model itself included), in module order."""
    return [m for m in model.modules() if isinstance(m, Module) and m.state == "tuned"]


def merge(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Overlapping or adjacent ranges joined."""
    out: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return tuple(out)


def intersect(a: Ranges, b: Ranges) -> Ranges:
    """The sizes both range sets cover."""
    return merge((max(x0, y0), min(x1, y1)) for x0, x1 in a for y0, y1 in b if max(x0, y0) <= min(x1, y1))


def _shape(value: int | Sequence[int] | None) -> tuple[int, ...] | None:
    """A shape as given, or a rank: that many axes of any size."""
    if value is None:
        return None
    if isinstance(value, int):
        return (-1,) * value
    return tuple(value)


@attrs.frozen
class InputSpec:
    """One named tensor input a request must send."""

    name: str
    required: bool
    dtype: torch.dtype | None = None
    """None when no tuned graph names this input: any dtype is passed on."""
    shape: tuple[int, ...] | None = attrs.field(default=None, converter=_shape)
    """The tuned shape, -1 on the batch axis and every dynamic axis; None when no tuned graph names it.
    Given as an int, a rank: that many axes of any size."""
    batch_axis: int = 0

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)


def model_graph(model: torch.nn.Module) -> Any:
    """The first tuned graph whose tensors are exactly the model's forward parameters (the model's own
    when the model itself was tuned, else the first tuned module called with the model's inputs
    unchanged, like the demo's ``features``), or None."""
    names = {p.name for p in _parameters(model)}
    for module in tuned_modules(model):
        for graph, _ in module.tuned_graphs:
            paths = [t.path for t in graph.inputs]
            if paths and set(paths) <= names and len(set(paths)) == len(paths):
                return graph
    return None


def input_specs(model: torch.nn.Module) -> dict[str, InputSpec]:
    """The model's forward parameters, typed and shaped by :func:`model_graph`."""
    graph = model_graph(model)
    typed = {t.path: t for t in graph.inputs} if graph is not None else {}
    specs = {}
    for p in _parameters(model):
        tensor = typed.get(p.name)
        if tensor is None:
            specs[p.name] = InputSpec(p.name, p.default is p.empty)
            continue
        shape = tuple(-1 if dim is not None else size for size, dim in zip(tensor.shape, tensor.dims))
        axis = tensor.batch_axis
        specs[p.name] = InputSpec(p.name, True, tensor.torch_dtype, shape, 0 if axis is None else axis)
    return specs


def forward_of(model: torch.nn.Module) -> Any:
    """The forward whose parameters name the model's inputs (the wrapped one, for a tuned model itself)."""
    return model.module.forward if isinstance(model, Module) else model.forward


def _parameters(model: torch.nn.Module) -> list[inspect.Parameter]:
    return [
        p
        for p in inspect.signature(forward_of(model)).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def named_outputs(output: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """A model's output as named tensors: ``output`` for one tensor, keys for a mapping (a
    ``ModelOutput`` too), ``output_0``... for a sequence, dotted for nested ones; other values dropped."""
    if isinstance(output, torch.Tensor):
        return {prefix or "output": output}
    if isinstance(output, Mapping):
        items = [(str(k), v) for k, v in output.items()]
    elif isinstance(output, (tuple, list)):
        items = [(f"output_{i}" if not prefix else str(i), v) for i, v in enumerate(output)]
    else:
        return {}
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(named_outputs(value, f"{prefix}.{key}" if prefix else key))
    return out


# -- the model the server runs ----------------------------------------------------------------------------


def resolve_factory(factory: Factory | str) -> Factory:
    """A callable, or ``package.module:name`` (the user's own choice, never read from the artifact)."""
    if callable(factory):
        return factory
    module_name, _, attr = str(factory).partition(":")
    if not module_name or not attr:
        raise ValueError(f"factory must be a callable or 'package.module:name', got {factory!r}")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import the model factory {factory!r}: {exc}") from exc
    if not callable(found):
        raise ValueError(f"the model factory {factory!r} is not callable")
    return found


def tuned_threads(artifact: str | Path) -> int | None:
    """The torch threads the artifact was tuned (and timed) with, bounded by this machine's cores."""
    try:
        with zipfile.ZipFile(artifact) as archive:
            if archive.getinfo("manifest.json").file_size > MAX_MANIFEST_BYTES:
                return None
            threads = json.loads(archive.read("manifest.json")).get("environment", {}).get("threads")
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None  # ait.load says what is wrong with the file
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        return None
    return min(threads, os.cpu_count() or 1)


# -- batches of requests ------------------------------------------------------------------------------------


class ClientError(ValueError):
    """What the client must change (a server answers it with a 4xx)."""


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


@attrs.frozen
class Call:
    """One model call, for metrics: its size (padding included), its real rows, and each tuned module's route."""

    size: int
    rows: int
    routes: tuple[Route, ...]


class BatchRunner:
    """Runs ``model`` on batches of checked requests, every call inside ``plan``'s tuned sizes
    (synchronous: an engine calls it in a thread of its own). ``on_call`` sees each model call."""

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
        self._signature = inspect.signature(forward_of(model))  # read once: a wrapped forward's is slow to read

    def client_error(self, message: str) -> ClientError:
        """The answer to a request the model cannot take (an engine's own 4xx type, in a subclass)."""
        return ClientError(message)

    def rows(self, request: Request) -> int:
        """The request's batch size (its first input's rows on its batch axis)."""
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
                return [self.client_error(refused.message())]
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
        spans: list[tuple[int, int, Call]] = []  # (first row, end row, call) per model call
        start = 0
        for take, size in self.plan.chunks(sum(counts)):
            part = {n: _rows(t, self.specs[n].batch_axis, start, take, size) for n, t in joined.items()}
            outputs, call = self._call(part, size, take)
            pieces.append({n: o.narrow(0, 0, take) for n, o in outputs.items()})
            spans.append((start, start + take, call))
            start += take
        merged = pieces[0] if len(pieces) == 1 else {n: torch.cat([p[n] for p in pieces]) for n in pieces[0]}
        answers: list[Answer | ClientError] = []
        first = 0
        for count in counts:
            calls = [c for lo, hi, c in spans if lo < first + count and first < hi]
            answers.append(
                Answer(
                    {n: o.narrow(0, first, count) for n, o in merged.items()},
                    tuple(dict.fromkeys(f"{r.module}={r.backend}" for c in calls for r in c.routes)),
                    tuple(dict.fromkeys(f"{r.module}: {r.reason}" for c in calls for r in c.routes if r.reason)),
                    tuple(c.size for c in calls),
                    len(requests),
                )
            )
            first += count
        return answers

    def _call(self, part: Request, size: int, rows: int) -> tuple[dict[str, torch.Tensor], Call]:
        with observe_routes() as seen:
            try:
                bound = self._signature.bind(**part)
                outputs = named_outputs(self.model(*bound.args, **bound.kwargs))
            except Exception as exc:
                raise _ModelRefused(exc, seen) from exc
        call = Call(size, rows, tuple(seen))
        self.on_call(call)
        for name, tensor in outputs.items():
            if tensor.dim() == 0 or tensor.shape[0] != size:
                raise RuntimeError(
                    f"output {name!r} has shape {tuple(tensor.shape)}: aitune serve splits a batched call's "
                    f"outputs on axis 0, which must hold the call's {size} rows"
                )
        return outputs, call


def _rows(tensor: torch.Tensor, axis: int, start: int, take: int, size: int) -> torch.Tensor:
    """Rows ``start .. start+take`` on ``axis``, padded to ``size`` rows by repeating the last one."""
    if size == take and start == 0 and tensor.shape[axis] == take:
        return tensor
    index = torch.arange(start, start + size).clamp(max=start + take - 1)
    return tensor.index_select(axis, index)


class _ModelRefused(Exception):
    """The model raised on a call; a client error when a tuned module had sent it eager (its input
    was outside what was tuned, and eager could not take it either), else the server's own."""

    def __init__(self, error: Exception, routes: Sequence[Route]) -> None:
        super().__init__(str(error))
        self.error = error
        self.outside = [f"{r.module}: {r.reason}" for r in routes if r.reason]

    def message(self) -> str:
        first_line = str(self.error).strip().splitlines()[0] if str(self.error).strip() else ""
        return (
            f"the model cannot take this input: {'; '.join(self.outside)}, and the model itself raised "
            f"{type(self.error).__name__}: {first_line}"
        )
