"""What a loaded artifact says about serving it: its inputs (names, dtypes, shapes with -1 on the
dynamic axes) and the batch sizes it was tuned for.

Read from the tuned modules' graphs (what ``ait.load`` installed from the manifest), so the server
batches exactly within what the artifact holds and its metadata says what a request must send.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

import aitune.torch as ait

Ranges = tuple[tuple[int, int], ...]
"""Sorted, disjoint, inclusive batch-size ranges."""

DATATYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "UINT8",
    torch.int8: "INT8",
    torch.int16: "INT16",
    torch.int32: "INT32",
    torch.int64: "INT64",
    torch.float16: "FP16",
    torch.float32: "FP32",
    torch.float64: "FP64",
    torch.bfloat16: "FP32",  # the protocol (and kserve) has no BF16: sent and answered as FP32
}
"""Torch dtypes as the Open Inference Protocol's datatypes."""


def datatype(dtype: torch.dtype) -> str:
    """The protocol's name for ``dtype``."""
    try:
        return DATATYPES[dtype]
    except KeyError:
        raise ValueError(f"the Open Inference Protocol has no datatype for {dtype}") from None


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
    """None when no tuned graph names this input: FP32 is assumed for the metadata, any dtype passes."""
    shape: tuple[int, ...] | None = None
    """The tuned shape, -1 on the batch axis and every dynamic axis; None when no tuned graph names it."""
    batch_axis: int = 0

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def datatype(self) -> str:
        return "FP32" if self.dtype is None else datatype(self.dtype)

    def metadata(self) -> dict[str, Any]:
        """The protocol's tensor metadata: name, datatype and shape (-1 where it varies)."""
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape or [-1])}


@attrs.frozen
class OutputSpec:
    """One named output tensor, as the metadata lists it."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def model_graph(model: torch.nn.Module) -> Any:
    """The first tuned graph whose tensors are exactly the model's forward parameters (the model's own
    when the model itself was tuned, else the first tuned module called with the model's inputs
    unchanged), or None."""
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


def output_specs(model: torch.nn.Module, outputs: Mapping[str, torch.Tensor]) -> dict[str, OutputSpec]:
    """Each output of a warm-up call: its name, datatype, and shape with -1 on axis 0 (the batch, which
    the server splits outputs on) and, where the model itself was tuned, on the axes its graph records
    as dynamic."""
    graph = model_graph(model) if isinstance(model, ait.Module) else None  # a submodule's outputs are not the model's
    recorded = list(graph.outputs) if graph is not None else []
    specs = {}
    for i, (name, tensor) in enumerate(outputs.items()):
        dims: Sequence[Any] = recorded[i].dims if len(recorded) == len(outputs) else [None] * tensor.dim()
        shape = tuple(
            -1 if axis == 0 or (axis < len(dims) and dims[axis] is not None) else size
            for axis, size in enumerate(tensor.shape)
        )
        specs[name] = OutputSpec(name, datatype(tensor.dtype), shape)
    return specs


def forward_of(model: torch.nn.Module) -> Any:
    """The forward whose parameters name the model's inputs (the wrapped one, for a tuned model itself)."""
    return model.module.forward if isinstance(model, ait.Module) else model.forward


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
