"""Which captured CUDA graphs are kept, and which shapes run without one: the policy, apart from the
CUDA calls (runtime.py).

A graph holds what its execution context set up for its input shape, so each captured shape gets
an execution context of its own: TensorRT 10 (aitune's floor) lets contexts share an optimisation
profile by default (8.6 needed the ``kPROFILE_SHARING_0806`` preview flag; up to 8.5 it was one
context per profile, which ``IExecutionContext``'s class comment in ``NvInferRuntime.h`` still
says). A context still counts how often its shapes were set (its binding) and every graph
remembers the count it was captured at: a graph whose context was set to another shape since is
stale, captured again, never replayed.

**Memory.** Every context of one engine runs on one shared allocation of activation memory
(``runtime.py``: ``USER_MANAGED`` contexts, ``set_device_memory``), so what a graph adds is its own
buffers: the static inputs it reads and the outputs it writes, counted in bytes, and at least
:data:`GRAPH_FLOOR_BYTES` for its execution context and executable graph, whose own memory
neither TensorRT nor CUDA reports. The graphs kept hold at most ``budget_bytes``.

**Which shapes get a graph.** Calls are counted per key (profile, shapes). A shape is captured
on its first call when its graph fits in what the budget has left. When it does not fit, graphs
are dropped for it only if each was called less than half as often (:data:`HOTTER`); otherwise
the call runs without a graph, on its profile's plain context, and the runner asks again when the
shape's count has doubled. So shapes that cycle through more
than the budget holds keep the graphs captured first and run the rest as plain enqueues: no
capture per call, which would synchronize the device and empty torch's caching allocator each
time (``torch.cuda.graph``). Every :data:`AGE_EVERY` calls the counts halve, so a shape that
becomes hot later still takes its place and shapes no longer called are forgotten.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Any

import attrs

GRAPH_FLOOR_BYTES = 1 << 20
"""The least a kept graph counts for (1 MiB): its execution context and executable graph hold memory
of their own that neither TensorRT nor CUDA reports, so many tiny graphs still meet the bound."""
HOTTER = 2
"""A graph is dropped for a new shape only when the new shape was called more than this many times
as often: two shapes called about equally never take each other's place (no capture storm)."""
AGE_EVERY = 1024
"""Calls between two halvings of every count."""


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
    nbytes: int = GRAPH_FLOOR_BYTES
    """What it counts for against the budget (:func:`graph_bytes`)."""


def graph_bytes(buffers: int) -> int:
    """What a graph whose static inputs and outputs take ``buffers`` bytes counts for."""
    return max(int(buffers), GRAPH_FLOOR_BYTES)


class GraphCache:
    """Captured graphs by key (profile, input shapes), within ``budget_bytes``, and calls counted per key."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._graphs: collections.OrderedDict[Hashable, CapturedGraph] = collections.OrderedDict()
        self._counts: dict[Hashable, int] = {}
        self._calls = 0
        self.recaptures = 0
        """Lookups that found the key's graph stale (its context was set to another shape since)."""

    # -- counting -------------------------------------------------------------------------------

    def record(self, key: Hashable) -> int:
        """Count one call of ``key``; its count now. Every :data:`AGE_EVERY` calls all counts halve."""
        self._counts[key] = self._counts.get(key, 0) + 1
        count = self._counts[key]
        self._calls += 1
        if self._calls % AGE_EVERY == 0:
            self._counts = {k: c // 2 for k, c in self._counts.items() if c // 2 or k in self._graphs}
        return count

    def count(self, key: Hashable) -> int:
        return self._counts.get(key, 0)

    @property
    def used_bytes(self) -> int:
        """What the kept graphs count for."""
        return sum(entry.nbytes for entry in self._graphs.values())

    # -- lookups --------------------------------------------------------------------------------

    def current(self, key: Hashable) -> CapturedGraph | None:
        """The key's graph if its context still has the binding it was captured at, else None."""
        entry = self._graphs.get(key)
        if entry is None:
            return None
        if entry.binding != entry.slot.bindings:
            self.recaptures += 1
            del self._graphs[key]
            return None
        self._graphs.move_to_end(key)
        return entry

    def room_for(self, key: Hashable, nbytes: int) -> list[Hashable] | None:
        """Whether ``key``'s graph (``nbytes``) may be captured: the keys of the graphs to drop first
        (none when it fits in what is left), or None: run it without a graph.

        Only graphs ``key`` is more than :data:`HOTTER` times as hot as are dropped for it, the
        least called first (the least recently used among equals).
        """
        if nbytes > self.budget_bytes:
            return None
        free = self.budget_bytes - self.used_bytes
        if nbytes <= free:
            return []
        hot = self.count(key)
        victims: list[Hashable] = []
        for kept in sorted(self._graphs, key=self.count):  # stable: least recently used first among equals
            if hot <= HOTTER * self.count(kept):
                break
            victims.append(kept)
            free += self._graphs[kept].nbytes
            if nbytes <= free:
                return victims
        return None

    # -- changes --------------------------------------------------------------------------------

    def add(self, key: Hashable, entry: CapturedGraph) -> None:
        """Keep ``entry`` (the caller made room with :meth:`room_for` and :meth:`drop`)."""
        self._graphs[key] = entry
        self._graphs.move_to_end(key)

    def drop(self, key: Hashable) -> CapturedGraph:
        """Stop keeping ``key``'s graph; returns it (its context may serve another graph)."""
        return self._graphs.pop(key)

    def kept(self) -> list[Hashable]:
        """The keys kept now, least recently used first."""
        return list(self._graphs)
