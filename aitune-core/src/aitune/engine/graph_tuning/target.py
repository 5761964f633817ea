"""What one graph tuning works on: the module, one of its graphs and the recorded calls of it.

A :class:`Target` never changes while it is tuned; a static-shape build gets another one, the same
graph pinned to one batch size (:meth:`Target.pinned`). It answers what every step asks of the
data: the batch sizes recorded, the batches profiling rotates through, the sizes to profile at.
"""

from __future__ import annotations

import collections
from pathlib import Path

import attrs
import torch

from ...backend import BuildContext
from ...graph import BATCH, GraphSpec, Sample, assemble, narrow
from ...profiling import ProfilingConfig
from ...session import Session


@attrs.frozen(kw_only=True, eq=False)
class Target:
    """One graph of one module, its recorded calls and where they run."""

    module_name: str
    module: torch.nn.Module
    graph: GraphSpec
    samples: list[Sample]
    """The recorded calls of ``graph`` (for a pinned target: those of its batch size)."""
    device: torch.device
    session: Session
    """The plugin session every hook call is handed."""
    batch_sizes: tuple[int, ...] | None = None
    """The batch sizes ``ait.tune`` was asked for, else None."""
    static_batch: int | None = None
    """The batch size this target's graph is pinned to (:meth:`pinned`), else None."""

    def pinned(self, batch_size: int) -> Target:
        """This graph with its batch axis pinned to ``batch_size``: what a static-shape build is made,
        checked and timed on. Its samples are the recorded calls of that size (else ones batched to it)."""
        sizes = self.recorded_batch_sizes()
        recorded = [s for s, size in zip(self.samples, sizes) if size == batch_size]
        return attrs.evolve(
            self,
            samples=recorded or self.inputs_at(batch_size),
            graph=narrow(self.graph, batch_size, batch_size),
            static_batch=batch_size,
        )

    def build_context(self, workdir: Path) -> BuildContext:
        """What a backend is handed to build this graph in ``workdir``."""
        from ...cachedir import cache_dir

        return BuildContext(self.graph, self.samples, self.device, workdir, cache_dir(), self.module_name)

    def recorded_batch_sizes(self) -> list[int]:
        """The batch size of each recorded sample, in recorded order (empty without a batch axis)."""
        for i, spec in enumerate(self.graph.inputs):
            axis = spec.batch_axis
            if axis is not None:
                return [int(s.tensors()[i].shape[axis]) for s in self.samples]
        return []

    def inputs_at(self, batch_size: int) -> list[Sample]:
        """The data profiling rotates through: a batch of ``batch_size`` starting at each recorded sample.

        Each batch is made as AITune makes one (successive recorded samples concatenated, see
        :func:`aitune.graph.assemble`), so batch-1 data is timed on real rows at every size.
        """
        if self.graph.batch is None:
            return list(self.samples)
        n = len(self.samples)
        return [assemble(self.graph, self.samples[k:] + self.samples[:k], {BATCH: batch_size}) for k in range(n)]

    def default_batch_sizes(self, config: ProfilingConfig, every_recorded: bool = False) -> list[int]:
        """The batch sizes to profile: the config's, else tune's, else the recorded ones.

        Throughput strategies ask for ``every_recorded`` size; the eager gate of OneBackend and
        FirstWins takes the most common recorded size (ties: the larger). A graph without a batch
        axis is profiled at its recorded leading size.
        """
        batch = self.graph.batch
        if batch is None:
            first = self.graph.inputs[0] if self.graph.inputs else None
            return [first.shape[0] if first is not None and first.rank else 1]
        wanted = config.batch_sizes or self.batch_sizes
        inside = sorted({b for b in wanted or () if b in batch})
        if inside:
            return inside
        recorded = self.recorded_batch_sizes() or [batch.opt]
        if every_recorded:
            return sorted(set(recorded))
        counts = collections.Counter(recorded)
        top = max(counts.values())
        return [max(b for b, n in counts.items() if n == top)]
