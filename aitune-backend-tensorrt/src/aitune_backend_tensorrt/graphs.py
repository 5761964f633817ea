"""Which captured CUDA graph may be replayed: the policy, apart from the CUDA calls (runtime.py).

A graph holds what its execution context set up for its input shape. Each captured shape gets an
execution context of its own: TensorRT 10 (aitune's floor) lets contexts share an optimisation
profile by default (8.6 needed the ``kPROFILE_SHARING_0806`` preview flag; up to 8.5 it was one
context per profile, which ``IExecutionContext``'s class comment in ``NvInferRuntime.h`` still
says). So shapes that alternate within one profile keep their graphs. A context still counts how
often its shapes were set (its binding) and every graph remembers the count it was captured at:
a graph whose context was set to another shape since is stale, captured again, never replayed.
Each context holds its own activation memory, so at most ``max_graphs`` graphs (and contexts)
are kept, least recently used dropped first.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Any

import attrs


@attrs.define
class Slot:
    """An execution context and the input shapes it is set to."""

    context: Any
    bound: tuple[tuple[int, ...], ...] | None = None
    out_shapes: list[tuple[int, ...]] = attrs.field(factory=list)
    bindings: int = 0
    """How many times its input shapes were set: a graph captured at another count is stale."""


@attrs.define
class CapturedGraph:
    graph: Any
    """The ``torch.cuda.CUDAGraph``."""
    inputs: list[Any]
    """Static input buffers the graph reads: each call copies its inputs in."""
    outputs: list[Any]
    """Static output buffers the graph writes: each call copies them out."""
    slot: Slot
    """The execution context the graph was captured on (its own)."""
    binding: int
    """Its context's binding count at capture."""


class GraphCache:
    """Captured graphs by key (profile, input shapes), at most ``max_graphs``, least recently used out first."""

    def __init__(self, max_graphs: int) -> None:
        self.max_graphs = max_graphs
        self._graphs: collections.OrderedDict[Hashable, CapturedGraph] = collections.OrderedDict()
        self.recaptures = 0
        """Lookups that found the key's graph stale (its context was set to another shape since)."""

    def current(self, key: Hashable) -> CapturedGraph | None:
        """The key's graph if its context still has the binding it was captured at, else None (capture it)."""
        entry = self._graphs.get(key)
        if entry is None:
            return None
        if entry.binding != entry.slot.bindings:
            self.recaptures += 1
            del self._graphs[key]
            return None
        self._graphs.move_to_end(key)
        return entry

    def add(self, key: Hashable, entry: CapturedGraph) -> list[CapturedGraph]:
        """Keep ``entry``; the graphs dropped to stay within ``max_graphs`` (their contexts go with them)."""
        self._graphs[key] = entry
        self._graphs.move_to_end(key)
        dropped = []
        while len(self._graphs) > self.max_graphs:
            dropped.append(self._graphs.popitem(last=False)[1])
        return dropped

    def drop_oldest(self) -> bool:
        """Drop the least recently used graph (to free its context's memory); False when none is kept."""
        if not self._graphs:
            return False
        self._graphs.popitem(last=False)
        return True

    def kept(self) -> list[Hashable]:
        """The keys kept now, least recently used first."""
        return list(self._graphs)
