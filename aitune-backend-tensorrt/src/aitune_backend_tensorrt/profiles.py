"""Optimisation profiles from graph specs: pure functions, so every rule is tested on CPU.

A TensorRT engine with dynamic axes is built for profiles, each a (min, opt, max) shape per
input; kernels are tuned for ``opt``. From the graph alone there is one profile: min and max of
each dimension's recorded or declared range, and opt at its most common recorded value
(``DimRange.opt``), because tuning for the max would favour calls that rarely happen. A user's
:class:`~aitune_backend_tensorrt.config.TensorRTProfile` list replaces it, for instance one
profile for short and one for long sequences; at run time the tightest profile that contains the
call's shapes runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from aitune.plugin import ConfigError, GraphSpec

from .config import Shape, TensorRTProfile


@attrs.frozen
class ShapeProfile:
    """One resolved profile: per graph input, in ``graph.inputs`` order, its (min, opt, max) shapes."""

    shapes: tuple[tuple[Shape, Shape, Shape], ...]

    def contains(self, shapes: Sequence[Shape]) -> bool:
        if len(shapes) != len(self.shapes):
            return False
        for shape, (lo, _, hi) in zip(shapes, self.shapes):
            if len(shape) != len(lo) or not all(a <= s <= b for s, a, b in zip(shape, lo, hi)):
                return False
        return True

    @property
    def span(self) -> int:
        """How wide the profile is (sum of max - min over every axis): smaller is more specialised."""
        return sum(b - a for lo, _, hi in self.shapes for a, b in zip(lo, hi))

    def to_json(self, names: Sequence[str]) -> dict[str, list[list[int]]]:
        return {name: [list(s) for s in triple] for name, triple in zip(names, self.shapes)}

    @classmethod
    def from_json(cls, data: dict[str, Any], names: Sequence[str]) -> ShapeProfile:
        return cls(tuple(tuple(tuple(int(d) for d in s) for s in data[name]) for name in names))  # type: ignore[misc]


def graph_profile(graph: GraphSpec) -> ShapeProfile:
    """The one profile the graph implies: its ranges' min and max, opt at the most common shape."""
    return ShapeProfile(
        tuple((graph.shape_at(s, "min"), graph.shape_at(s, "opt"), graph.shape_at(s, "max")) for s in graph.inputs)
    )


def resolve_profiles(graph: GraphSpec, profiles: Sequence[TensorRTProfile]) -> list[ShapeProfile]:
    """The profiles to build: the user's, completed from the graph, or the graph's own one."""
    if not profiles:
        return [graph_profile(graph)]
    return [_resolve(graph, p, i) for i, p in enumerate(profiles)]


def _resolve(graph: GraphSpec, profile: TensorRTProfile, index: int) -> ShapeProfile:
    where = f"profiles[{index}]"
    paths = [s.path for s in graph.inputs]
    unknown = sorted(set(profile.shapes) - set(paths))
    if unknown:
        raise ConfigError(f"TensorRTBackendConfig.{where} names {unknown}, but the graph's inputs are {paths}")
    # Named dimensions a listed input fixes, so unlisted inputs sharing the name follow it.
    fixed: dict[str, tuple[int, int, int]] = {}
    for spec in graph.inputs:
        if spec.path not in profile.shapes:
            continue
        lo, opt, hi = profile.shapes[spec.path]
        if len(lo) != spec.rank:
            raise ConfigError(
                f"TensorRTBackendConfig.{where}[{spec.path!r}] has rank {len(lo)}, but the input has rank {spec.rank}"
            )
        for axis, (name, static) in enumerate(zip(spec.dims, spec.shape)):
            triple = (lo[axis], opt[axis], hi[axis])
            if name is None:
                if triple != (static, static, static):
                    raise ConfigError(
                        f"TensorRTBackendConfig.{where}[{spec.path!r}] axis {axis} is static ({static}) in the "
                        f"graph, but the profile gives {triple}; make it ({static}, {static}, {static})"
                    )
                continue
            if fixed.setdefault(name, triple) != triple:
                raise ConfigError(
                    f"TensorRTBackendConfig.{where}: dimension {name!r} is {fixed[name]} in one input and "
                    f"{triple} in {spec.path!r}; inputs that share a dimension need the same (min, opt, max)"
                )
    out = []
    for spec in graph.inputs:
        if spec.path in profile.shapes:
            out.append(profile.shapes[spec.path])
            continue
        per_axis = [
            (size, size, size)
            if name is None
            else fixed.get(name, (graph.dims[name].min, graph.dims[name].opt, graph.dims[name].max))
            for size, name in zip(spec.shape, spec.dims)
        ]
        out.append(tuple(tuple(t[k] for t in per_axis) for k in range(3)))  # type: ignore[arg-type]
    return ShapeProfile(tuple(out))


def select_profile(profiles: Sequence[ShapeProfile], shapes: Sequence[Shape]) -> int | None:
    """Index of the tightest profile containing ``shapes`` (ties: the first), or None."""
    best: int | None = None
    for i, profile in enumerate(profiles):
        if profile.contains(shapes) and (best is None or profile.span < profiles[best].span):
            best = i
    return best


def uncovered(graph: GraphSpec, profiles: Sequence[ShapeProfile], cases: Sequence[Sequence[Shape]]) -> str | None:
    """Why ``profiles`` leave a recorded call or a range extreme without an engine, or None."""
    extremes = [[graph.shape_at(s, which) for s in graph.inputs] for which in ("min", "max")]
    for label, shapes in [*((f"recorded sample {i}", c) for i, c in enumerate(cases)), *zip(("min", "max"), extremes)]:
        if select_profile(profiles, shapes) is None:
            shown = ", ".join(f"{s.path}={tuple(shape)}" for s, shape in zip(graph.inputs, shapes))
            return (
                f"no optimisation profile contains the {label} shapes ({shown}); widen a TensorRTProfile "
                "or add one that covers them"
            )
    return None
