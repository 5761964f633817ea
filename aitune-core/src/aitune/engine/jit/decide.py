"""Deciding what becomes of a candidate once it has recorded enough calls.

In order: a decision remembered by an earlier run is reused when its winners still match the
module; a module TorchDynamo cannot capture as one graph stays eager; otherwise core's own
per-module tuner picks a winner per graph by the strategy. A module that stays eager because of
graph breaks or because no backend produced a correct build hands over to its children, down to
``settings.max_depth``. Every outcome is remembered in the decision store for the next run.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ...backend import Backend
from ...graph import GraphSpec, Sample
from ...profiling import ProfilingConfig
from ...registry import BackendRegistry
from ...report import ModuleReport
from ...session import Session
from .. import recording
from ..install import install
from ..options import TuneOptions
from ..plan import TuneRun, default_backends, plan_module, weights_device
from ..progress import Step, TuneProgress
from ..strategies import FirstWinsStrategy, TuneStrategy
from ..winners import Winner, eager_only
from . import decision_store
from .admission import admit
from .settings import settings
from .sharing import measuring_strategy
from .state import STATE, Decision, JitCandidate, check_stopping

logger = logging.getLogger("aitune")

JIT_OPTIONS = TuneOptions(batch_one_sizes=None)
"""What every JIT decision runs with: ``ait.tune``'s plain options, tuning each graph for the batch
sizes it was called with (batch-1 calls are not widened to AITune's default sizes)."""


def tune_candidate(module: torch.nn.Module, cand: JitCandidate) -> None:
    """Tune one candidate and record the decision; a failure leaves the module eager, never broken."""
    STATE.modules[module] = "tuning"
    try:
        with torch.no_grad(), recording.bypass():
            decision = _decide(module, cand)
    except Exception as exc:  # the JIT never breaks the program it tunes
        logger.warning("aitune jit: tuning %s failed (%s: %s); it runs eager", cand.name, type(exc).__name__, exc)
        STATE.modules[module] = "eager"
        decision = _decision(module, cand, "eager", reason=f"{type(exc).__name__}: {exc}")
    STATE.decisions.append(decision)


class StoppableProgress(TuneProgress):
    """The JIT's progress: each step (a build, a validation, a profile) is where the background tuner
    stops once the program exits (see :mod:`.background`)."""

    def __init__(self) -> None:
        super().__init__(False)

    @contextlib.contextmanager
    def step(self, description: str, stage: str | None = None, charge_to: Sequence[str] = ()) -> Iterator[Step]:
        check_stopping()
        with super().step(description, stage, charge_to) as step:
            yield step


def _decision(module: torch.nn.Module, cand: JitCandidate, outcome: str, **kwargs: Any) -> Decision:
    cls = type(module)
    return Decision(cand.name, f"{cls.__module__}.{cls.__qualname__}", cand.depth, outcome, **kwargs)


def _decide(module: torch.nn.Module, cand: JitCandidate) -> Decision:
    rec = cand.recording.modules[id(cand.wrapper)]
    graphs = list(rec.graphs.values())
    broken = next((g.error for g in graphs if g.error), None)
    if broken:
        return _descend(module, cand, f"a recorded call cannot be tuned: {broken}")
    source = STATE.manager_source
    if source is None:  # disable() ran while this module waited for its turn
        raise RuntimeError("JIT tuning was switched off (aitune.torch.jit.disable) before this module's turn")
    manager = source()
    device = weights_device(cand.twin) or torch.device("cpu")
    strategy, candidates = _strategy(device, manager.registry)
    run = TuneRun(
        session=manager.session(),
        device=device,
        defaults=candidates,
        options=JIT_OPTIONS,
        progress=StoppableProgress(),
    )
    for g in graphs:  # the hooks saw each call after it ran: which inputs it updates is found by running it
        recording.find_updates(g, cand.twin)
    module_plan = plan_module(run, rec)
    specs = [g.graph for g in module_plan.graphs]
    key = None
    if settings.remember:
        key = decision_store.decision_key(run, cand.twin, specs, strategy.identity())
        remembered = decision_store.load(run, key, cand.name, cand.twin, specs)
        if remembered is not None:
            wrong = _stale_winner(cand, graphs, remembered, run.session)
            if wrong is None:
                return _reuse(module, cand, remembered)
            logger.warning(
                "aitune jit: the remembered winner for %s no longer matches the module (%s); tuning it again",
                cand.name,
                wrong,
            )
            decision_store.forget(key)
    if settings.detect_graph_breaks:
        for g in graphs:
            check_stopping()
            reason = graph_break_reason(cand.twin, g.samples[0])
            if reason:
                why = f"TorchDynamo cannot capture it as one graph: {reason}"
                _remember(run, key, cand, "descended", why)
                logger.info("aitune jit: %s stays eager (%s); trying its children", cand.name, why)
                return _descend(module, cand, why)
    from ..tuner import module_report, tune_recorded

    object.__setattr__(cand.wrapper, "strategy", strategy)
    check_stopping()
    report = module_report(cand.wrapper)
    winners = tune_recorded(run, module_plan, report) or []
    if not eager_only(winners):
        names = _install(module, cand, winners, report)
        _remember(run, key, cand, "tuned", report.summary, winners)
        logger.info("aitune jit: tuned %s", report.summary)
        return _decision(module, cand, "tuned", backends=names, reason=report.summary)
    why = report.error or "; ".join(g.reason for g in report.graphs if g.reason) or report.summary
    if report.status == "failed" or not _any_correct(report):
        _remember(run, key, cand, "descended", why)
        logger.info("aitune jit: %s stays eager (%s); trying its children", cand.name, why)
        return _descend(module, cand, why)
    _remember(run, key, cand, "eager", why)
    logger.info("aitune jit: %s stays eager: %s", cand.name, why)
    STATE.modules[module] = "eager"
    return _decision(module, cand, "eager", reason=why)


def _stale_winner(
    cand: JitCandidate, graphs: Sequence[Any], remembered: decision_store.Remembered, session: Session
) -> str | None:
    """Why a remembered winner is wrong for the module as it is now (checked on the recorded calls), or None."""
    recorded = [s for g in graphs for s in g.samples]
    for graph, backend in remembered.winners:
        if backend is None:
            continue
        samples = [s for s in recorded if graph.mismatch(s.tensors()) is None] or [graph.example("opt")]
        result = session.hook.aitune_validate(
            backend=backend,
            reference=cand.twin,
            samples=samples,
            graph=graph,
            tolerances=None,
            masked_by=None,
            session=session,
        )
        if not result.passed:
            return f"{backend.name}: {result.reason}"
    return None


def _reuse(module: torch.nn.Module, cand: JitCandidate, remembered: decision_store.Remembered) -> Decision:
    if remembered.outcome == "tuned":
        winners = [Winner(g, b) for g, b in remembered.winners if b is not None]
        names = _install(module, cand, winners, None)
        logger.info("aitune jit: reusing tuned %s (%s) from cache", cand.name, ", ".join(dict.fromkeys(names)))
        return _decision(module, cand, "tuned", backends=names, from_cache=True, reason=remembered.reason)
    if remembered.outcome == "descended":
        logger.info("aitune jit: reusing decision for %s from cache: stays eager, trying its children", cand.name)
        return _descend(module, cand, remembered.reason, from_cache=True)
    logger.info("aitune jit: reusing decision for %s from cache: stays eager", cand.name)
    STATE.modules[module] = "eager"
    return _decision(module, cand, "eager", from_cache=True, reason=remembered.reason)


def _install(
    module: torch.nn.Module, cand: JitCandidate, winners: Sequence[Winner], report: ModuleReport | None
) -> tuple[str, ...]:
    """Route ``module``'s inference calls to ``winners`` (eager ones run its own forward); the backends used."""
    install(module, winners, report, name=cand.name, canonicalize=cand.wrapper.canonicalizer)
    STATE.tuned.add(module)
    STATE.modules[module] = "tuned"
    return tuple(w.backend.name for w in winners if w.backend.name != decision_store.EAGER)


def _remember(
    run: TuneRun,
    key: str | None,
    cand: JitCandidate,
    outcome: str,
    reason: str,
    winners: Sequence[tuple[GraphSpec, Backend]] = (),
) -> None:
    if key is not None:
        decision_store.save(run, key, name=cand.name, outcome=outcome, reason=reason, winners=winners)


def _descend(module: torch.nn.Module, cand: JitCandidate, why: str, from_cache: bool = False) -> Decision:
    STATE.modules[module] = "descended"
    if cand.depth >= settings.max_depth:
        return _decision(
            module, cand, "eager", from_cache=from_cache, reason=f"{why}; max_depth={settings.max_depth} reached"
        )
    for path, child in _children(module):
        if child not in STATE.modules:
            admit(child, f"{cand.name}.{path}", cand.depth + 1)
    return _decision(module, cand, "descended", from_cache=from_cache, reason=why)


def graph_break_reason(module: torch.nn.Module, sample: Sample) -> str | None:
    """Why TorchDynamo cannot capture ``module`` as one graph on ``sample``, or None when it can.

    Traces with ``fullgraph=True`` and a backend that compiles nothing. Unlike
    ``torch._dynamo.explain`` it does not reset Dynamo, so modules compiled earlier stay compiled.
    """
    import torch._dynamo

    dynamo = torch._dynamo.config
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"

    def capture(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return gm.forward

    try:
        with dynamo.patch(**{name: max(getattr(dynamo, name), 256)}), torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*global hooks on modules", category=UserWarning)
            torch.compile(module, backend=capture, fullgraph=True)(*sample.args, **sample.kwargs)
    except Exception as exc:
        text = str(exc).strip()
        return next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    return None


def _strategy(device: torch.device, registry: BackendRegistry) -> tuple[TuneStrategy, list[Backend]]:
    """The strategy for a module on ``device`` and the candidate backends it will try, in order."""
    strategy = settings.strategy
    if strategy is None:
        if settings.backends is not None:
            for name in settings.backends:  # named by the user: one that cannot run here is an error
                registry.require(name, device)
            strategy = FirstWinsStrategy([registry.backend_class(n)() for n in settings.backends], _profiling())
        else:
            # a backend that compiles almost anything (the Inductor JIT) is the fallback behind the exporting ones
            ordered = sorted(default_backends(registry, device), key=lambda b: b.compiles_anything)
            strategy = FirstWinsStrategy(ordered, _profiling())
    defaults = default_backends(registry, device) if strategy.backends is None else []
    return strategy, strategy.candidates(defaults)


def _profiling() -> ProfilingConfig:
    """The default profiling, timed as background mode shares the machine (see :mod:`.background`)."""
    return ProfilingConfig(measuring_strategy=measuring_strategy())


def _any_correct(report: ModuleReport) -> bool:
    return any(c.validation is not None and c.validation.passed for g in report.graphs for c in g.candidates)


def _children(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """Direct children, looking through containers that have no forward (ModuleList, ModuleDict)."""
    for name, child in module.named_children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            yield from _children(child, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", child
