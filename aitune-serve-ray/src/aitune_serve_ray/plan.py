"""What a loaded artifact says about serving it: the batch sizes it was tuned for and its inputs.

Read from the tuned modules themselves (``ait.load`` installed their graphs), so the server batches
exactly within what the artifact holds: calls are split above the largest tuned batch size and
padded up to the smallest, and a request's tensors are checked against the tuned inputs' names,
dtypes and ranks before it joins a batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

import aitune.torch as ait

Ranges = tuple[tuple[int, int], ...]
"""Sorted, disjoint, inclusive batch-size ranges."""


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


def tuned_modules(model: torch.nn.Module) -> list[ait.Module]:
    """The tuned ``ait.Module``s in ``model`` (the model itself included), in module order."""
    return [m for m in model.modules() if isinstance(m, ait.Module) and m.state == "tuned"]


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


@attrs.frozen
class InputSpec:
    """One named tensor input a request must send."""

    name: str
    required: bool
    dtype: torch.dtype | None = None
    """None when no tuned graph names this input: any dtype is passed on."""
    rank: int | None = None
    batch_axis: int = 0


def input_specs(model: torch.nn.Module) -> dict[str, InputSpec]:
    """The model's forward parameters, typed by the first tuned graph whose tensors are exactly them.

    That graph is the model's own when the model itself was tuned, else the first tuned module
    called with the model's inputs unchanged (the demo's ``features``).
    """
    params = [
        p
        for p in inspect.signature(forward_of(model)).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    names = {p.name for p in params}
    typed: dict[str, Any] = {}
    for module in tuned_modules(model):
        for graph, _ in module.tuned_graphs:
            paths = [t.path for t in graph.inputs]
            if paths and set(paths) <= names and len(set(paths)) == len(paths):
                typed = {t.path: t for t in graph.inputs}
                break
        if typed:
            break
    specs = {}
    for p in params:
        tensor = typed.get(p.name)
        if tensor is None:
            specs[p.name] = InputSpec(p.name, p.default is p.empty)
        else:
            axis = tensor.batch_axis
            specs[p.name] = InputSpec(p.name, True, tensor.torch_dtype, tensor.rank, 0 if axis is None else axis)
    return specs


def call_arguments(model: torch.nn.Module, named: dict[str, Any]) -> tuple[Sequence[Any], dict[str, Any]]:
    """``named`` as the positional and keyword arguments of ``model``'s forward (as tuning called it)."""
    bound = inspect.signature(forward_of(model)).bind(**named)
    return bound.args, bound.kwargs


def forward_of(model: torch.nn.Module) -> Any:
    """The forward whose parameters name the model's inputs (the wrapped one, for a tuned model itself)."""
    return model.module.forward if isinstance(model, ait.Module) else model.forward
