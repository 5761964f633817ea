"""What a tune works with, and the plan of a run: each recorded graph of each wrapped module.

A :class:`TuneRun` carries what one ``ait.tune`` (or one JIT decision) works with: the run's
:class:`~aitune.session.Session` (hook relay, registries, builds), the device, the default
candidates, the user's :class:`~.options.TuneOptions` and where progress shows. It is passed
down, never looked up, as pytest passes ``config.hook``. :func:`modules` plans the run once
(module, then graph: its batch sizes, spec, strategy and candidates) and every step walks that
plan: the agreement between ranks, the fan-out of builds ahead, the tuner and the other ranks'
rebuild of rank 0's winners.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ..backend import Backend
from ..graph import GraphSpec, infer_graph
from ..registry import BackendRegistry
from ..report import GraphReport
from ..session import Session
from .figures import SharedFigures
from .graph_tuning import GraphTuning
from .options import TuneOptions
from .progress import TuneProgress
from .recording import GraphRecording, ModuleRecording, bypass
from .strategies import MaxThroughputStrategy, TuneStrategy

if TYPE_CHECKING:
    from .module import Module

logger = logging.getLogger("aitune")


def _backends(values: Iterable[Backend]) -> tuple[Backend, ...]:
    return tuple(values)


@attrs.frozen(kw_only=True)
class TuneRun:
    """What one tune works with: handed down from ``ait.tune`` (or the JIT) to every step."""

    session: Session
    """The run's hook relay, registries and builds: every build, validation and profile goes through it."""
    device: torch.device
    defaults: tuple[Backend, ...] = attrs.field(converter=_backends)
    """The default candidates (strategies without their own backend list try these)."""
    options: TuneOptions = attrs.field(factory=TuneOptions)
    """What the user asked for, validated once."""
    shared: SharedFigures | None = None
    """Ranks deciding on the slowest rank's figures (``rank_decision="slowest"``), else None."""
    progress: TuneProgress = attrs.field(factory=lambda: TuneProgress(False))
    """Where the steps of the run show (always logged)."""

    @property
    def hook(self) -> Any:
        return self.session.hook

    @property
    def registry(self) -> BackendRegistry:
        return self.session.registry


@attrs.define(slots=False, eq=False, kw_only=True)
class GraphPlan:
    """One recorded graph of one module, planned once for every step of the run: the batch sizes it is
    tuned for, its spec, its strategy and the candidates that strategy tries (each worked out on first use)."""

    run: TuneRun
    module: Module
    index: int
    """Its place among the module's graphs, in the order they were first recorded."""
    recorded: GraphRecording

    @property
    def not_tuned(self) -> str | None:
        """Why this graph is not tuned at all: its calls cannot be tuned (``recorded.error``) or run eager
        by design (``recorded.eager_reason``); None for a graph to tune."""
        return self.recorded.error or self.recorded.eager_reason

    @functools.cached_property
    def sizes(self) -> Sequence[int] | None:
        """The batch sizes it is tuned for: ``batch_sizes``, or for batch-1 data ``batch_one_sizes``."""
        options = self.run.options
        return sizes_for(self.recorded, options.batch_sizes, options.batch_one_sizes)

    @functools.cached_property
    def graph(self) -> GraphSpec:
        """Its spec; raises :class:`~aitune.errors.AituneError` when the recorded calls make none (they
        contradict the module's ``dynamic_shapes``, say)."""
        return graph_of(self.module, self.recorded, self.sizes)

    @functools.cached_property
    def strategy(self) -> TuneStrategy:
        return strategy_for(self.module, self.index, self.graph.key)

    def candidates(self) -> list[Backend]:
        """The backends its strategy tries, in the strategy's order."""
        return self.strategy.candidates(self.run.defaults)

    def tuning(self, report: GraphReport) -> GraphTuning:
        """What its strategy works on, writing into ``report``; the module's tolerances and accuracy rule
        win over the run's."""
        module, options = self.module, self.run.options
        return GraphTuning(
            module_name=module.name,
            module=module.module,
            graph=self.graph,
            samples=list(self.recorded.samples),
            device=self.run.device,
            session=self.run.session,
            batch_sizes=self.sizes,
            tolerances=module.tolerances or options.tolerances,
            report=report,
            shared=self.run.shared,
            progress=self.run.progress,
            masked_by=module.masked_by,
            accuracy=module.accuracy.over(options.accuracy),
        )


@attrs.frozen
class ModulePlan:
    """The plan of one recorded module: one :class:`GraphPlan` per recorded graph, in recorded order."""

    recording: ModuleRecording[Module]
    graphs: tuple[GraphPlan, ...]

    @property
    def module(self) -> Module:
        return self.recording.module


def plan_module(run: TuneRun, recording: ModuleRecording[Module]) -> ModulePlan:
    """The plan of one recorded module (the JIT plans one at a time)."""
    graphs = (
        GraphPlan(run=run, module=recording.module, index=i, recorded=g)
        for i, g in enumerate(recording.graphs.values())
    )
    return ModulePlan(recording, tuple(graphs))


def modules(run: TuneRun, recordings: Iterable[ModuleRecording[Module]]) -> Iterator[ModulePlan]:
    """The plan of the run, module by module, in recorded order."""
    for recording in recordings:
        yield plan_module(run, recording)


def graphs(plans: Iterable[ModulePlan]) -> Iterator[GraphPlan]:
    """Every graph of every module of ``plans``, in order."""
    for plan in plans:
        yield from plan.graphs


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
    graph_rec: Any, batch_sizes: Sequence[int] | None, batch_one_sizes: Sequence[int] | None
) -> Sequence[int] | None:
    """The batch sizes one graph is tuned for: ``batch_sizes``, or for batch-1 data ``batch_one_sizes``."""
    if graph_rec.mutated:  # a KV cache has the batch size it was made with: built as recorded
        return None
    return batch_sizes or (batch_one_sizes if _batch_one(graph_rec.samples) else None)


def graph_of(module: Module, graph_rec: Any, sizes: Sequence[int] | None) -> Any:
    """The graph spec of one recorded input structure of ``module``, for the batch sizes of :func:`sizes_for`,
    with the rows of the embedding tables its integer inputs index (:func:`table_rows`)."""
    graph = infer_graph(
        graph_rec.samples,
        module.canonicalizer.arg_names,
        module.dynamic_shapes,
        sizes,
        graph_rec.outputs,
        facts=graph_rec.values or None,  # every recorded call's values, not only the kept samples'
    )
    graph = graph.with_rows(table_rows(graph_rec, module.module))
    if graph_rec.mutated:
        graph = attrs.evolve(graph, mutated=tuple(graph.inputs[i].path for i in sorted(graph_rec.mutated)))
    return graph


_TABLES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def table_rows(graph: GraphRecording, module: torch.nn.Module) -> list[int | None]:
    """Per input leaf of ``graph``'s samples, the rows of the embedding table of ``module`` that indexes
    it as it is (the fewest, where several do), else None (:attr:`ValueFacts.rows <aitune.graph.ValueFacts.rows>`).

    Found by running ``module`` once more on a copy of the first sample with a pre-hook on each
    ``nn.Embedding`` and ``nn.EmbeddingBag``: an input reaches a table as it is when the table's input
    is that tensor or a view of all of it (``input_ids.view(-1, n)``). A graph with no integer input,
    or a module with no table, is not run; a run that raises finds nothing.
    """
    tables = [m for m in module.modules() if isinstance(m, _TABLES)]
    if not tables or not graph.samples or graph.error or graph.eager_reason:
        return []
    sample = graph.samples[0].fresh() if graph.mutated else graph.samples[0]
    leaves = sample.tensors()
    found: list[int | None] = [None] * len(leaves)
    ids = [i for i, t in enumerate(leaves) if not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)]
    if not ids:
        return found

    def seen(rows: int, table: torch.nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        for i in ids:
            if isinstance(x, torch.Tensor) and _same_values(x, leaves[i]):
                current = found[i]
                found[i] = rows if current is None else min(current, rows)

    handles = [table.register_forward_pre_hook(functools.partial(seen, table.num_embeddings)) for table in tables]
    try:
        with bypass(), torch.no_grad():
            module(*sample.args, **sample.kwargs)
    except Exception:  # it ran while recording; whatever stops it now, no table is known
        return [None] * len(found)
    finally:
        for handle in handles:
            handle.remove()
    return found


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` holds exactly ``b``'s values in ``b``'s order: ``b`` itself, or a contiguous view of all of it."""
    return a is b or (
        a.dtype == b.dtype
        and a.device == b.device
        and a.numel() == b.numel() > 0
        and a.data_ptr() == b.data_ptr()
        and a.is_contiguous()
        and b.is_contiguous()
    )


def _batch_one(samples: Sequence[Any]) -> bool:
    """True for AITune-style data: every tensor of every recorded call has a leading size of 1."""
    tensors = [t for s in samples for t in s.tensors() if t.dim() > 0]
    return bool(tensors) and all(t.shape[0] == 1 for t in tensors)
