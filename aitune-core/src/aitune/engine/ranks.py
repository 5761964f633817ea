"""Ranks of a ``torch.distributed`` job tuning one model together (see :mod:`aitune.distributed`).

1. Every rank records its own data; :func:`plan` says what it would tune (each graph, strategy and
   candidate list) and :func:`agree` checks that every rank's plan is rank 0's.
2. Rank 0 tunes (builds, validates, profiles, decides) while the others wait. Its report is the
   decision, sent to the others as JSON.
3. Every other rank builds exactly rank 0's winners on its own device, checks them against its own
   eager module, and installs them. Its report is rank 0's, with its own builds and validation.

With ``rank_decision="slowest"`` step 2 and 3 are one: every rank tunes its own builds in lockstep,
and each profiling round's figures (and the dispatch cost) are exchanged so that every rank
decides on the slowest rank's (:class:`SlowestRank`). Ranks then check that they decided alike.

A failure on any rank in any step fails ``ait.tune`` on every rank with that rank's error, and
every rank's modules then run eager, so no two ranks run different code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ..backend import Backend
from ..converter import structure, unstructure
from ..distributed import Coordinator
from ..errors import AituneError, BuildError, DistributedTuneError, TuningError, ValidationError
from ..graph import narrow
from ..registry import BackendRegistry
from ..report import CandidateReport, GraphReport, ModuleReport, ProfileResult, TuneReport
from ..text import clip
from .install import install
from .plan import ModulePlan, TuneRun
from .winners import Winner

if TYPE_CHECKING:
    from .module import Module
from .figures import ProfileOutcome
from .graph_tuning import GraphTuning


class RankMismatchError(DistributedTuneError):
    """Ranks recorded different graphs or would try different candidates."""


def _config(registry: BackendRegistry, backend: Backend) -> dict[str, Any]:
    try:
        return registry.config_to_json(backend.config, backend.name)
    except AituneError:
        return {"backend": backend.name}


def plan(plans: Sequence[ModulePlan], run: TuneRun) -> dict[str, Any]:
    """What this rank would tune, as JSON: modules, graphs (devices by type), strategies, candidates."""
    modules = []
    for module_plan in plans:
        graphs: list[dict[str, Any]] = []
        for graph_plan in module_plan.graphs:
            if graph_plan.not_tuned:
                graphs.append({"eager": graph_plan.not_tuned})
                continue
            try:
                graph = graph_plan.graph
            except AituneError as exc:
                graphs.append({"error": str(exc)})
                continue
            candidates = [_config(run.registry, b) for b in graph_plan.candidates()]
            graphs.append(
                # ranks that saw other token ids agree on the same graph: values are not compared
                {
                    "graph": unstructure(graph.without_values()),
                    "strategy": graph_plan.strategy.identity_data(),
                    "candidates": candidates,
                }
            )
        modules.append({"module": module_plan.module.name, "graphs": graphs})
    return {"device": run.device.type, "modules": modules}


def agree(group: Coordinator) -> None:
    """Raise :class:`RankMismatchError` on every rank when any rank's plan differs from rank 0's."""
    found = _differing_rank(group, "plan")
    if found:
        rank, where = found
        raise RankMismatchError(
            f"rank {rank} would tune something other than rank 0, so they cannot share one decision: {where}. "
            "Give every rank batches of the same shapes and dtypes, the same ait.Module wrappers and strategies, "
            "and the same installed backends",
            rank=rank,
        )


def _differing_rank(group: Coordinator, key: str) -> tuple[int, str] | None:
    """The first rank whose ``key`` in the last exchange differs from rank 0's, and where; or None."""
    values = [message[key] for message in group.inbox]
    for rank, other in enumerate(values[1:], 1):
        where = _first_difference(values[0], other, key, rank)
        if where:
            return rank, where
    return None


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
        return f"{path} is {clip(str(a), 200)!r} on rank 0 and {clip(str(b), 200)!r} on rank {rank}"
    return None


def tune_together(
    group: Coordinator,
    *,
    tune_all: Callable[[], None],
    plans: Sequence[ModulePlan],
    report: TuneReport,
    run: TuneRun,
) -> None:
    """Rank 0 tunes and decides and every other rank installs its winners, or (``run.shared``) every
    rank tunes on the slowest rank's figures. Fills ``report``."""
    if run.shared is not None:
        return _tune_on_slowest(group, tune_all, plans, report)
    decisions: list[tuple[Module, list[Winner], ModuleReport | None]] = []
    try:
        with group.step("tuning on rank 0") as outbox:
            if group.rank == 0:
                tune_all()
                outbox["report"] = report.to_json()
        decided = TuneReport.from_json(group.inbox[0]["report"])
        with group.step("installing rank 0's winners"):
            if group.rank != 0:
                for module_plan, winners, mine in rebuild(group.rank, plans, decided):
                    decisions.append((module_plan.module, winners, mine))
                    report.modules.append(mine)
    except DistributedTuneError:
        decisions = _all_eager(plans)
        raise
    finally:
        _install_all(decisions)
    report.environment["distributed"] = {"rank": group.rank, "world_size": group.world_size, "decided_by": 0}


def _tune_on_slowest(
    group: Coordinator,
    tune_all: Callable[[], None],
    plans: Sequence[ModulePlan],
    report: TuneReport,
) -> None:
    try:
        with group.step("tuning on every rank") as outbox:
            tune_all()
            outbox["decisions"] = _decisions(report)
        found = _differing_rank(group, "decisions")
        if found:
            rank, where = found
            raise DistributedTuneError(
                f"the ranks decided differently on the same figures: {where}; a strategy that decides on "
                "anything but the shared figures cannot use rank_decision='slowest'",
                rank=rank,
                final=True,
            )
    except DistributedTuneError:
        _install_all(_all_eager(plans))
        raise
    report.environment["distributed"] = {
        "rank": group.rank,
        "world_size": group.world_size,
        "decided_by": "slowest",
    }


def _decisions(report: TuneReport) -> list[dict[str, Any]]:
    """What each graph of each module runs: the part of a report every rank must agree on."""
    return [
        {
            "module": m.name,
            "status": m.status,
            "graphs": [
                {"decision": g.decision, "routes": [[r.batch_min, r.batch_max, r.backend] for r in g.routes]}
                for g in m.graphs
            ],
        }
        for m in report.modules
    ]


class SlowestRank:
    """Shared figures of ``rank_decision="slowest"``: each is the slowest rank's, the same on every rank.

    Every profiling round is one step: the ranks exchange their results as JSON, and each
    candidate's result becomes the one of the rank where its p50 is highest, paired with that
    rank's eager windows, so its speedup and interval are its slowest rank's. The eager result
    shown is the highest eager p50. A runner that raised on any rank fails on every rank; out of
    memory on any rank ends the sweep on every rank. Ranks whose rounds timed different
    candidates fail together.
    """

    def __init__(self, group: Coordinator) -> None:
        self.group = group

    def profiles(self, step: str, outcome: ProfileOutcome) -> ProfileOutcome:
        mine: dict[str, Any] = {"out_of_memory": outcome.out_of_memory, "failed_key": outcome.failed_key}
        if outcome.failed_key is not None:
            mine["error"] = f"{type(outcome.error).__name__}: {outcome.error}"
        if outcome.results is not None:
            mine["results"] = {key: unstructure(result) for key, result in outcome.results.items()}
        with self.group.step(step) as outbox:
            outbox["profile"] = mine
        theirs = [m["profile"] for m in self.group.inbox]
        failed = next((r for r, t in enumerate(theirs) if t["failed_key"] is not None), None)
        if failed is not None:
            if failed == self.group.rank:
                return outcome
            error = RuntimeError(f"on rank {failed}: {theirs[failed]['error']}")
            return ProfileOutcome(failed_key=theirs[failed]["failed_key"], error=error)
        if any(t["out_of_memory"] for t in theirs):
            return ProfileOutcome(out_of_memory=True)
        keys = sorted(theirs[0]["results"])
        other = next((r for r, t in enumerate(theirs) if sorted(t["results"]) != keys), None)
        if other is not None:
            raise DistributedTuneError(
                f"rank 0 timed {', '.join(keys)} while rank {other} timed {', '.join(sorted(theirs[other]['results']))} "
                f"({step}): a candidate built or passed validation on some ranks only",
                rank=other,
                final=True,
            )
        per_rank = [
            {key: structure(value, ProfileResult, "profile") for key, value in t["results"].items()} for t in theirs
        ]
        base = outcome.baseline_key
        merged = {}
        for key in keys:
            slowest = max(per_rank, key=lambda results: results[key].p50_ms)
            merged[key] = slowest[key]
            if base is not None and key != base:  # paired with the eager windows of its own slowest rank
                eager = slowest[base]
                merged[key] = attrs.evolve(
                    slowest[key], baseline_p50_ms=eager.p50_ms, baseline_window_p50_ms=list(eager.window_p50_ms)
                )
        return ProfileOutcome(merged, baseline_key=base)

    def cost_ms(self, step: str, value: float) -> float:
        with self.group.step(step) as outbox:
            outbox["cost_ms"] = value
        return max(float(m["cost_ms"]) for m in self.group.inbox)


def _install_all(decisions: Sequence[tuple[Module, list[Winner], ModuleReport | None]]) -> None:
    for module, winners, mine in decisions:
        install(module, winners, mine)


def _all_eager(plans: Sequence[ModulePlan]) -> list[tuple[Module, list[Winner], ModuleReport | None]]:
    """Every module running eager, with no report: what a tune the ranks could not finish leaves."""
    return [(p.module, [], None) for p in plans]


def rebuild(
    rank: int, plans: Sequence[ModulePlan], decided: TuneReport
) -> Iterator[tuple[ModulePlan, list[Winner], ModuleReport]]:
    """Build and check rank 0's winners for each module of this rank, with this rank's report of them."""
    for module_plan, chosen in zip(plans, decided.modules):
        mine = structure(unstructure(chosen), ModuleReport, "report")
        winners: list[Winner] = []
        if mine.status != "failed":
            for graph_plan, graph_report in zip(module_plan.graphs, mine.graphs):
                if graph_plan.not_tuned:
                    continue  # runs eager on every rank, as rank 0 reported
                graph = graph_plan.graph
                templates = graph_plan.candidates()
                tuning = graph_plan.tuning(GraphReport(graph.key, {}))
                where = f"{module_plan.module.name} graph {graph_plan.index}"
                if graph_report.routes:
                    built: dict[tuple[str, int | None], Backend] = {}
                    for route in graph_report.routes:
                        backend = tuning.eager.backend
                        if route.backend != "torch_eager":
                            static = route.batch_min if route.static else None
                            if (route.backend, static) not in built:
                                routed = _selected(graph_report, route.backend, static, where)
                                built[route.backend, static] = _build_winner(
                                    tuning if static is None else tuning.pinned(static),
                                    templates=templates,
                                    selected=routed,
                                    rank=rank,
                                    where=where,
                                )
                            backend = built[route.backend, static]
                        winners.append(Winner(narrow(graph, route.batch_min, route.batch_max), backend))
                    continue
                selected = next((c for c in graph_report.candidates if c.status == "selected"), None)
                backend = tuning.eager.backend
                if selected is not None:
                    backend = _build_winner(tuning, templates=templates, selected=selected, rank=rank, where=where)
                winners.append(Winner(graph, backend))
        yield module_plan, winners, mine


def _selected(graph_report: GraphReport, backend: str, static_batch: int | None, where: str) -> CandidateReport:
    """Rank 0's selected ``backend`` candidate: its build for ``static_batch`` alone, or (None) its dynamic one."""
    for candidate in graph_report.candidates:
        if candidate.backend == backend and candidate.static_batch == static_batch and candidate.status == "selected":
            return candidate
    which = f"{backend} built for batch {static_batch}" if static_batch is not None else backend
    raise TuningError(f"{where}: rank 0's report routes to {which} but selected no such candidate")


def _build_winner(
    tuning: GraphTuning, *, templates: Sequence[Backend], selected: CandidateReport, rank: int, where: str
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
