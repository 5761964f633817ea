"""Ranks of a ``torch.distributed`` job tuning one model together (see :mod:`aitune.distributed`).

1. Every rank records its own data; :func:`plan` says what it would tune (each graph, strategy and
   candidate list) and :func:`agree` checks that every rank's plan is rank 0's.
2. Rank 0 tunes (builds, validates, profiles, decides) while the others wait. Its report is the
   decision, sent to the others as JSON.
3. Every other rank builds exactly rank 0's winners on its own device, checks them against its own
   eager module, and installs them. Its report is rank 0's, with its own builds and validation.

A failure on any rank in any step fails ``ait.tune`` on every rank with that rank's error, and
every rank's modules then run eager, so no two ranks run different code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..backend import Backend
from ..converter import structure, unstructure
from ..distributed import Coordinator
from ..errors import AituneError, BuildError, DistributedTuneError, TuningError, ValidationError
from ..registry import BackendRegistry
from ..report import CandidateReport, GraphReport, ModuleReport, TuneReport
from . import recording
from .plan import TuneRun, graph_of, graph_tuning, strategy_for

if TYPE_CHECKING:
    from .module import Module
from .candidates import GraphTuning, narrow


class RankMismatchError(DistributedTuneError):
    """Ranks recorded different graphs or would try different candidates."""


def _config(registry: BackendRegistry, backend: Backend) -> dict[str, Any]:
    try:
        return registry.config_to_json(backend.config, backend.name)
    except AituneError:
        return {"backend": backend.name}


def plan(recs: Sequence[recording.ModuleRecording[Module]], run: TuneRun) -> dict[str, Any]:
    """What this rank would tune, as JSON: modules, graphs (devices by type), strategies, candidates."""
    modules = []
    for rec in recs:
        graphs: list[dict[str, Any]] = []
        for index, graph_rec in enumerate(rec.graphs.values()):
            if graph_rec.error or graph_rec.eager_reason:
                graphs.append({"eager": graph_rec.error or graph_rec.eager_reason})
                continue
            try:
                graph = graph_of(rec.module, graph_rec, run.sizes_for(graph_rec))
            except AituneError as exc:
                graphs.append({"error": str(exc)})
                continue
            strategy = strategy_for(rec.module, index, graph.key)
            candidates = [_config(run.registry, b) for b in strategy.candidates(run.defaults)]
            graphs.append({"graph": unstructure(graph), "strategy": repr(strategy), "candidates": candidates})
        modules.append({"module": rec.module.name, "graphs": graphs})
    return {"device": run.device.type, "modules": modules}


def agree(group: Coordinator) -> None:
    """Raise :class:`RankMismatchError` on every rank when any rank's plan differs from rank 0's."""
    plans = [message["plan"] for message in group.inbox]
    for rank, other in enumerate(plans[1:], 1):
        where = _first_difference(plans[0], other, "plan", rank)
        if where:
            raise RankMismatchError(
                f"rank {rank} would tune something other than rank 0, so they cannot share one decision: {where}. "
                "Give every rank batches of the same shapes and dtypes, the same ait.Module wrappers and strategies, "
                "and the same installed backends",
                rank=rank,
            )


def _first_difference(a: Any, b: Any, path: str, rank: int) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            found = _first_difference(a.get(key), b.get(key), f"{path}.{key}", rank)
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path} has {len(a)} entries on rank 0 and {len(b)} on rank {rank}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}[{i}]", rank)
            if found:
                return found
        return None
    if a != b:
        return f"{path} is {str(a)[:200]!r} on rank 0 and {str(b)[:200]!r} on rank {rank}"
    return None


def tune_together(
    group: Coordinator,
    tune_all: Callable[[], None],
    recs: Sequence[recording.ModuleRecording[Module]],
    report: TuneReport,
    run: TuneRun,
) -> None:
    """Rank 0 tunes and decides; every other rank installs rank 0's winners. Fills ``report``."""
    try:
        with group.step("tuning on rank 0") as outbox:
            if group.rank == 0:
                tune_all()
                outbox["report"] = report.to_json()
        decided = TuneReport.from_json(group.inbox[0]["report"])
        with group.step("installing rank 0's winners"):
            if group.rank != 0:
                install(group.rank, recs, decided, report, run)
    except DistributedTuneError:
        for rec in recs:
            rec.module._install([], None)
        raise
    report.environment["distributed"] = {"rank": group.rank, "world_size": group.world_size, "decided_by": 0}


def install(
    rank: int,
    recs: Sequence[recording.ModuleRecording[Module]],
    decided: TuneReport,
    report: TuneReport,
    run: TuneRun,
) -> None:
    """Build, check and install rank 0's winners for every module of this rank."""
    for rec, chosen in zip(recs, decided.modules):
        module = rec.module
        mine = structure(unstructure(chosen), ModuleReport, "report")
        winners: list[tuple[Any, Backend]] = []
        if mine.status != "failed":
            for index, (graph_rec, graph_report) in enumerate(zip(rec.graphs.values(), mine.graphs)):
                if graph_rec.error or graph_rec.eager_reason:
                    continue  # runs eager on every rank, as rank 0 reported
                sizes = run.sizes_for(graph_rec)
                graph = graph_of(module, graph_rec, sizes)
                templates = strategy_for(module, index, graph.key).candidates(run.defaults)
                tuning = graph_tuning(run, module, graph, graph_rec.samples, sizes, GraphReport(graph.key, {}))
                where = f"{module.name} graph {index}"
                if graph_report.routes:
                    built: dict[str, Backend] = {}
                    for route in graph_report.routes:
                        backend = tuning.eager.backend
                        if route.backend != "torch_eager":
                            if route.backend not in built:
                                routed = _selected(graph_report, route.backend, where)
                                built[route.backend] = _build_winner(tuning, templates, routed, rank, where)
                            backend = built[route.backend]
                        winners.append((narrow(graph, route.batch_min, route.batch_max), backend))
                    continue
                selected = next((c for c in graph_report.candidates if c.status == "selected"), None)
                backend = tuning.eager.backend
                if selected is not None:
                    backend = _build_winner(tuning, templates, selected, rank, where)
                winners.append((graph, backend))
        module._install(winners, mine)
        report.modules.append(mine)


def _selected(graph_report: GraphReport, backend: str, where: str) -> CandidateReport:
    for candidate in graph_report.candidates:
        if candidate.backend == backend and candidate.status == "selected":
            return candidate
    raise TuningError(f"{where}: rank 0's report routes to {backend} but selected no such candidate")


def _build_winner(
    tuning: GraphTuning, templates: Sequence[Backend], selected: CandidateReport, rank: int, where: str
) -> Backend:
    """Build rank 0's choice here and check it against this rank's eager module; record both."""
    template = next((t for t in templates if _config(tuning.registry, t) == selected.config), None)
    template = template or next((t for t in templates if t.name == selected.backend), None)
    if template is None:
        raise TuningError(f"{where}: rank {rank} has no candidate {selected.backend} that rank 0 chose")
    candidate = tuning.build(template)
    if not candidate.ok:
        raise BuildError(
            f"{where}: rank {rank} could not build {selected.backend}, which rank 0 chose: {candidate.report.reason}"
        )
    if not tuning.validate(candidate):
        raise ValidationError(
            f"{where}: {selected.backend}, which rank 0 chose, does not match eager on rank {rank}: "
            f"{candidate.report.reason}"
        )
    selected.build_time_s = candidate.report.build_time_s
    selected.from_cache = candidate.report.from_cache
    selected.build_info = candidate.report.build_info
    selected.validation = candidate.report.validation
    return candidate.backend
