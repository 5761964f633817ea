"""From aitune's graph spec to the shape declarations of torch.export and Torch-TensorRT.

A graph names each varying axis (``batch``, ``d0``...) and gives it min/opt/max; axes sharing a
name always have the same size. torch.export wants one ``torch.export.Dim`` per name (shared
objects make export enforce the equality), and Torch-TensorRT wants one ``Input`` per tensor with
min/opt/max shapes (one TensorRT optimisation profile). Both are derived here, without
torch_tensorrt, so they are tested on any machine.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

from aitune.plugin import DimRange, GraphSpec, Sample, TensorSpec, exclusive, resize


def dynamic_ranges(graph: GraphSpec) -> dict[str, DimRange]:
    """The symbolic dimensions that really vary (min < max); the others are static."""
    return {name: rng for name, rng in graph.dims.items() if rng.min != rng.max}


def unexportable_reason(graph: GraphSpec) -> str | None:
    """Why torch.export cannot keep this graph's dimensions dynamic, or None."""
    for name, rng in dynamic_ranges(graph).items():
        if rng.max < 2:
            return (
                f"dimension {name!r} ranges over {rng.min}..{rng.max}; torch.export specialises sizes 0 "
                "and 1, so it cannot stay dynamic: record inputs with larger sizes or declare it static"
            )
    return None


def export_dim_names(graph: GraphSpec) -> dict[str, str]:
    """A distinct Python identifier per dynamic dimension (torch.export.Dim names must be ones)."""
    out: dict[str, str] = {}
    for name in dynamic_ranges(graph):
        ident = re.sub(r"\W", "_", name)
        if not ident or not (ident[0].isalpha() or ident[0] == "_"):
            ident = f"dim_{ident}"
        candidate, n = ident, 1
        while candidate in out.values():
            candidate, n = f"{ident}_{n}", n + 1
        out[name] = candidate
    return out


def export_dims(graph: GraphSpec) -> dict[str, Any]:
    """One ``torch.export.Dim`` per dynamic dimension name, bounded by the graph's min and max."""
    names = export_dim_names(graph)
    return {
        name: torch.export.Dim(names[name], min=rng.min, max=rng.max) for name, rng in dynamic_ranges(graph).items()
    }


def trace_sizes(graph: GraphSpec) -> dict[str, int]:
    """Sizes to trace at: opt, but at least 2 for dynamic dimensions (sizes 0 and 1 get specialised)."""
    dynamic = dynamic_ranges(graph)
    return {name: min(rng.max, max(2, rng.opt)) if name in dynamic else rng.opt for name, rng in graph.dims.items()}


def trace_sample(graph: GraphSpec, sample: Sample) -> Sample:
    """A real recorded sample, resized (cycling its own rows) to :func:`trace_sizes`."""
    return resize(graph, sample, trace_sizes(graph))


def _map_leaves(graph: GraphSpec, leaf: Callable[[TensorSpec], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The graph's (args, kwargs) tree with ``leaf(spec)`` at every tensor and None at every constant."""
    specs: Iterator[TensorSpec] = iter(graph.inputs)

    def walk(node: dict[str, Any]) -> Any:
        kind = node["kind"]
        if kind == "tensor":
            return leaf(next(specs))
        if kind == "const":
            return None
        if kind == "dict":
            return {k: walk(n) for k, n in zip(node["keys"], node["items"])}
        items = [walk(n) for n in node["items"]]
        return items if kind == "list" else tuple(items)

    args_node, kwargs_node = graph.structure["items"]
    return tuple(walk(n) for n in args_node["items"]), walk(kwargs_node)


def dynamic_shapes(graph: GraphSpec, dims: dict[str, Any], forward: Callable[..., Any]) -> dict[str, Any]:
    """The ``dynamic_shapes`` argument of ``torch.export.export`` for a module whose forward is ``forward``.

    Each tensor gets ``{axis: dims[name]}`` for its dynamic axes (None when it has none); the tree
    is bound to ``forward``'s signature, the way torch.export matches it to the call.
    """

    def axes(spec: TensorSpec) -> dict[int, Any] | None:
        found = {axis: dims[name] for axis, name in enumerate(spec.dims) if name in dims}
        return found or None

    args, kwargs = _map_leaves(graph, axes)
    return dict(inspect.signature(forward).bind(*args, **kwargs).arguments)


def export_program(module: torch.nn.Module, graph: GraphSpec, sample: Sample) -> torch.export.ExportedProgram:
    """``torch.export.export`` of ``module`` at ``sample`` with every dynamic dimension of ``graph``."""
    traced = trace_sample(graph, sample)
    shapes = dynamic_shapes(graph, export_dims(graph), module.forward)
    with exclusive(module) as copy:  # a copy: the program's calls never meet the trace
        return torch.export.export(copy, tuple(traced.args), dict(traced.kwargs), dynamic_shapes=shapes)


@attrs.frozen
class InputProfile:
    """The shapes one input tensor takes: one TensorRT optimisation profile entry."""

    path: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]
    dtype: torch.dtype

    @property
    def is_static(self) -> bool:
        return self.min == self.max

    def input_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``torch_tensorrt.Input`` for this tensor."""
        if self.is_static:
            return {"shape": self.opt, "dtype": self.dtype}
        return {"min_shape": self.min, "opt_shape": self.opt, "max_shape": self.max, "dtype": self.dtype}


def input_profiles(graph: GraphSpec) -> list[InputProfile]:
    """Per input tensor, in flatten order, its min/opt/max shapes and dtype."""
    return [
        InputProfile(
            spec.path,
            graph.shape_at(spec, "min"),
            graph.shape_at(spec, "opt"),
            graph.shape_at(spec, "max"),
            spec.torch_dtype,
        )
        for spec in graph.inputs
    ]


def tensorrt_inputs(graph: GraphSpec, make_input: Callable[..., Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(arg_inputs, kwarg_inputs)`` for Torch-TensorRT: ``make_input(**kwargs)`` in every tensor's place.

    ``make_input`` is ``torch_tensorrt.Input``; constants keep the values the graph recorded, since
    torch.export bakes them into the program.
    """
    inputs = [make_input(**p.input_kwargs()) for p in input_profiles(graph)]
    return graph.unflatten(inputs)


def warmup_samples(graph: GraphSpec, samples: list[Sample]) -> list[Sample]:
    """What a build runs before it is done: the trace-size call, every recorded one, then min and max.

    After these, every shape the validator tries has been compiled, so no compile is left for a
    user's first call.
    """
    if not samples:
        raise ValueError("a build needs at least one recorded sample")
    calls = [trace_sample(graph, samples[0]), *samples]
    if graph.dims:
        for which in ("min", "max"):
            calls.append(resize(graph, samples[0], {n: getattr(r, which) for n, r in graph.dims.items()}))
    return calls


def mark_dynamic(graph: GraphSpec, sample: Sample) -> Sample:
    """A copy of ``sample`` whose tensors tell torch.compile which axes are dynamic, and their bounds.

    The tensors are cloned, so the recorded sample keeps no compiler marks.
    """
    dynamic = dynamic_ranges(graph)
    tensors = []
    for t, spec in zip(graph.flatten(sample.args, sample.kwargs), graph.inputs):
        t = t.clone()
        for axis, name in enumerate(spec.dims):
            if name in dynamic and t.shape[axis] >= 2:
                torch._dynamo.mark_dynamic(t, axis, min=dynamic[name].min, max=dynamic[name].max)
        tensors.append(t)
    args, kwargs = graph.unflatten(tensors)
    return Sample(args, kwargs)
