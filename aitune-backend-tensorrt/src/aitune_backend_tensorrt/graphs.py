"""Which captured CUDA graph may be replayed: the policy, apart from the CUDA calls (runtime.py).

A graph holds what its execution context set up for its input shape. TensorRT allows one context
per optimisation profile, so the shapes of one profile share a context, and setting it to shape B
leaves shape A's graph describing a setup the context no longer has. Each context therefore counts
how often its shapes were set (its binding), every graph remembers the count it was captured at,
and a graph whose context has been set since is stale: it is captured again, never replayed.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Any

import attrs


@attrs.define
class CapturedGraph:
    graph: Any
    """The ``torch.cuda.CUDAGraph``."""
    inputs: list[Any]
    """Static input buffers the graph reads: each call copies its inputs in."""
    outputs: list[Any]
    """Static output buffers the graph writes: each call copies them out."""
    binding: int
    """Its context's binding count at capture."""


class GraphCache:
    """Captured graphs by key (profile, input shapes), at most ``max_graphs``, least recently used out first."""

    def __init__(self, max_graphs: int) -> None:
        self.max_graphs = max_graphs
        self._graphs: collections.OrderedDict[Hashable, CapturedGraph] = collections.OrderedDict()
        self.recaptures = 0
        """Lookups that found the key's graph stale (its context was set to another shape since)."""

    def current(self, key: Hashable, binding: int) -> CapturedGraph | None:
        """The key's graph if its context still has the binding it was captured at, else None (capture it)."""
        entry = self._graphs.get(key)
        if entry is None:
            return None
        if entry.binding != binding:
            self.recaptures += 1
            del self._graphs[key]
            return None
        self._graphs.move_to_end(key)
        return entry

    def add(self, key: Hashable, entry: CapturedGraph) -> None:
        self._graphs[key] = entry
        self._graphs.move_to_end(key)
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)

    def kept(self) -> list[Hashable]:
        """The keys kept now, least recently used first."""
        return list(self._graphs)
