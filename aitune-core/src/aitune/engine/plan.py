"""What a tune works with, and how one recorded graph of a wrapped module is planned.

A :class:`TuneRun` carries what one ``ait.tune`` (or one JIT decision) was handed: the run's
:class:`~aitune.session.Session` (hook relay, registries, builds), the device, the default
candidates, the user's settings and where progress shows. It is passed down, never looked up, as
pytest passes ``config.hook``. The tuner, the fan-out of
builds ahead and the agreement between ranks all plan a graph the same way (sizes, spec,
strategy, :class:`GraphTuning`); this module is that one way, below all three.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ..backend import Backend, Tolerance
from ..graph import GraphSpec, Sample, infer_graph
from ..registry import BackendRegistry
from ..report import GraphReport
from ..session import Session
from .figures import SharedFigures
from .graph_tuning import GraphTuning
from .progress import TuneProgress
from .strategies import MaxThroughputStrategy, TuneStrategy

if TYPE_CHECKING:
    from .module import Module

logger = logging.getLogger("aitune")

AITUNE_DEFAULT_BATCH_SIZES = (1, 2)
"""What ``batch_sizes=None`` means for data of batch-1 items, as in AITune."""


def _as_tuple(values: Iterable[Any] | None) -> Any:
    return tuple(values) if values is not None else None


@attrs.frozen
class TuneRun:
    """What one tune works with: handed down from ``ait.tune`` (or the JIT) to every step."""

    session: Session
    """The run's hook relay, registries and builds: every build, validation and profile goes through it."""
    device: torch.device
    defaults: tuple[Backend, ...] = attrs.field(converter=lambda values: _as_tuple(values))
    """The default candidates (strategies without their own backend list try these)."""
    batch_sizes: tuple[int, ...] | None = attrs.field(default=None, converter=lambda values: _as_tuple(values))
    tolerances: Mapping[str, Tolerance] | None = None
    batch_one_sizes: tuple[int, ...] | None = AITUNE_DEFAULT_BATCH_SIZES
    """What ``batch_sizes=None`` means for a graph whose recorded calls all have batch 1."""
    fail_fast: bool = False
    dry_run: bool = False
    shared: SharedFigures | None = None
    """Ranks deciding on the slowest rank's figures (``rank_decision="slowest"``), else None."""
    progress: TuneProgress = attrs.field(factory=lambda: TuneProgress(False))
    """Where the steps of the run show (always logged)."""
    metric: Any = None
    """The user's accuracy metric for every module that names none (see :mod:`aitune.metrics`)."""
    accuracy_budget: float | None = None
    """How far the metric may fall below 1.0; with it, quantizing variants join the default candidates."""

    @property
    def hook(self) -> Any:
        return self.session.hook

    @property
    def registry(self) -> BackendRegistry:
        return self.session.registry

    def sizes_for(self, graph_rec: Any) -> Sequence[int] | None:
        """The batch sizes one recorded graph is tuned for."""
        return sizes_for(graph_rec, self.batch_sizes, self.batch_one_sizes)


def weights_device(module: torch.nn.Module) -> torch.device | None:
    """Where ``module``'s first parameter (else buffer) lives; None for a module without either."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device
    return None


def default_backends(registry: BackendRegistry, device: torch.device, quantized: bool = False) -> list[Backend]:
    """Every installed backend that can run on ``device`` and is a default candidate, eager excluded,
    once per config it lists as a default variant (:meth:`Backend.default_configs`), and with
    ``quantized`` (an accuracy budget was given) once per quantizing variant too."""
    out: list[Backend] = []
    for name in registry.names():
        spec = registry.spec(name)
        if name == "torch_eager" or not spec.default_candidate or registry.unavailable(name, device):
            continue
        try:
            cls = registry.backend_class(name)
            configs = [*cls.default_configs(), *(cls.quantized_configs() if quantized else [])]
            out.extend(cls(config) for config in configs)
        except Exception as exc:  # a plugin that cannot even construct its default is skipped, loudly
            logger.warning("backend %s skipped: %s: %s", name, type(exc).__name__, exc)
    return out


def strategy_for(module: Module, index: int, key: str) -> TuneStrategy:
    if module.strategies is not None:
        if isinstance(module.strategies, Mapping):
            chosen = module.strategies.get(index, module.strategies.get(key))
        else:
            chosen = module.strategies[index] if index < len(module.strategies) else None
        if chosen is not None:
            return chosen
    if module.strategy is not None:
        return module.strategy
    from .settings import settings

    return settings.default_strategy() if settings.default_strategy is not None else MaxThroughputStrategy()


def sizes_for(
    graph_rec: Any,
    batch_sizes: Sequence[int] | None,
    batch_one_sizes: Sequence[int] | None = AITUNE_DEFAULT_BATCH_SIZES,
) -> Sequence[int] | None:
    """The batch sizes one graph is tuned for: ``batch_sizes``, or for batch-1 data ``batch_one_sizes``."""
    if graph_rec.mutated:  # a KV cache has the batch size it was made with: built as recorded
        return None
    return batch_sizes or (batch_one_sizes if _batch_one(graph_rec.samples) else None)


def graph_of(module: Module, graph_rec: Any, sizes: Sequence[int] | None) -> Any:
    """The graph spec of one recorded input structure of ``module``, for the batch sizes of :func:`sizes_for`."""
    graph = infer_graph(
        graph_rec.samples, module._canonicalize.arg_names, module.dynamic_shapes, sizes, graph_rec.outputs
    )
    if graph_rec.mutated:
        graph = attrs.evolve(graph, mutated=tuple(graph.inputs[i].path for i in sorted(graph_rec.mutated)))
    return graph


def graph_tuning(
    run: TuneRun,
    module: Module,
    graph: GraphSpec,
    samples: Sequence[Sample],
    sizes: Sequence[int] | None,
    graph_report: GraphReport,
) -> GraphTuning:
    """What a strategy works on for one graph of ``module``, with the run's hooks and registry."""
    return GraphTuning(
        module.name,
        module.module,
        graph,
        list(samples),
        run.device,
        run.session,
        sizes,
        module.tolerances or run.tolerances,
        graph_report,
        run.shared,
        run.progress,
        module.masked_by,
        module.metric or run.metric,
        module.accuracy_budget if module.accuracy_budget is not None else run.accuracy_budget,
    )


def _batch_one(samples: Sequence[Any]) -> bool:
    """True for AITune-style data: every tensor of every recorded call has a leading size of 1."""
    tensors = [t for s in samples for t in s.tensors() if t.dim() > 0]
    return bool(tensors) and all(t.shape[0] == 1 for t in tensors)
