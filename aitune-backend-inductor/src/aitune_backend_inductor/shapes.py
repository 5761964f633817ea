"""Which shapes the inductor backends compile for, from the graph's named dynamic dimensions."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from aitune.plugin import DimRange, GraphSpec, Sample, resize


def dim_sizes(graph: GraphSpec, sample: Sample) -> dict[str, int]:
    """The size each named dimension takes in ``sample``."""
    sizes: dict[str, int] = {}
    for t, spec in zip(graph.flatten(sample.args, sample.kwargs), graph.inputs):
        for axis, name in enumerate(spec.dims):
            if name is not None:
                sizes.setdefault(name, int(t.shape[axis]))
    return sizes


def warmup_cases(graph: GraphSpec, samples: Sequence[Sample]) -> list[tuple[str, Sample]]:
    """Every recorded sample, then the graph's corners, so no call in range compiles later.

    The corners are all dimensions at min, all at max and, with several dimensions, each one at its
    min while the others are at max: sizes 0 and 1 are where torch specializes a dynamic axis.
    """
    cases = [(f"sample {i}", s) for i, s in enumerate(samples)]
    if not graph.dims or not samples:
        return cases
    lows = {n: r.min for n, r in graph.dims.items()}
    highs = {n: r.max for n, r in graph.dims.items()}
    corners = [lows, highs]
    if len(graph.dims) > 1:
        corners += [{**highs, n: r.min} for n, r in graph.dims.items()]
    for sizes in corners:
        label = ", ".join(f"{n}={v}" for n, v in sizes.items())
        cases.append((label, resize(graph, samples[0], sizes)))
    return cases


def unseen_sizes(graph: GraphSpec, seen: Sequence[dict[str, int]]) -> dict[str, int] | None:
    """Sizes inside every dimension's range that no warm-up used (to prove no call recompiles).

    None when some dimension has no such size (its range holds only warmed sizes) or is below 2.
    """
    out: dict[str, int] = {}
    for name, rng in graph.dims.items():
        used = {s[name] for s in seen if name in s}
        mid = (rng.min + rng.max) // 2
        candidates = [mid, mid + 1, mid - 1, rng.min + 1, rng.max - 1]
        fresh = [v for v in candidates if max(rng.min, 2) <= v <= rng.max and v not in used]
        if not fresh:
            return None
        out[name] = fresh[0]
    return out or None


def unwarmed_sizes(rng: DimRange, used: Iterable[int], want: int = 2) -> tuple[int, list[int]]:
    """How many sizes of ``rng`` (from 2 up: torch specializes 0 and 1) no warm-up used, and up to
    ``want`` of them, nearest the middle first (the sizes a run-time call is likeliest to take)."""
    lo = max(rng.min, 2)
    warm = {u for u in used if lo <= u <= rng.max}
    count = max(0, rng.max - lo + 1) - len(warm)
    mid = (lo + rng.max) // 2
    picks: list[int] = []
    for step in range(rng.max - lo + 1):
        if len(picks) >= want:
            break
        for v in (mid + step, mid - step - 1):
            if lo <= v <= rng.max and v not in warm and v not in picks and len(picks) < want:
                picks.append(v)
    return count, picks


def trace_sizes(graph: GraphSpec) -> dict[str, int]:
    """Sizes to trace an export at: the opt size, moved off 0 and 1 (which torch would specialize)."""
    sizes = {}
    for name, rng in graph.dims.items():
        size = rng.opt
        if size < 2 <= rng.max:
            size = max(2, rng.min)
        sizes[name] = size
    return sizes


def export_dynamic_shapes(graph: GraphSpec) -> tuple[Any, dict[str, list[int]]]:
    """``torch.export`` dynamic shapes of ``graph``'s flat inputs (see :class:`aitune.graph.FlatModule`):
    one ``Dim`` per named dimension, with its range.

    A dimension whose range is a single size is exported static. Returns the spec and the ranges
    it asks for, by name.
    """
    from torch.export import Dim

    dims = {n: Dim(n, min=r.min, max=r.max) for n, r in graph.dims.items() if r.min < r.max}
    if not dims:
        return None, {}
    per_input = tuple(
        {axis: dims[name] for axis, name in enumerate(spec.dims) if name in dims} or None for spec in graph.inputs
    )
    ranges = {n: [graph.dims[n].min, graph.dims[n].max] for n in dims}
    return (per_input,), ranges
