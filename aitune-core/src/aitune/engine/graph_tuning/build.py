"""Build: a backend template in, a :class:`Candidate` out (built, or failed, skipped, not applicable).

The ``aitune_build`` hook builds (the build cache and worker isolation wrap it); failures are
recorded in the candidate's report entry, never raised. The step's seconds are split into export,
waiting and build in the report's time breakdown.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...backend import EXPORT_S, WAIT_S, Backend
from ...builtin.eager import TorchEagerBackend
from ...errors import ConfigError, NotApplicableError, SerializationError
from ...report import CandidateReport
from .. import recording
from ..progress import TuneProgress
from .candidate import Candidate
from .ledger import Ledger
from .target import Target


def eager(target: Target) -> Candidate:
    """Eager PyTorch as a candidate: the module as it is, the baseline every other is timed against."""
    backend = TorchEagerBackend()
    backend.build(target.module, target.build_context(Path(tempfile.gettempdir())))
    return Candidate(backend, CandidateReport("torch_eager", {"backend": "torch_eager"}), reported=True)


def build(ledger: Ledger, template: Backend) -> Candidate:
    """Build a fresh copy of ``template`` for the ledger's target; failures are recorded, not raised."""
    target, progress = ledger.target, ledger.progress
    session = target.session
    candidate = _entry(ledger, template)
    backend = candidate.backend
    reason = session.registry.unavailable(backend, target.device, target.graph)
    if reason:
        return ledger.fail(candidate, "availability", reason, None)
    if progress.out_of_time():
        return ledger.skip(candidate, progress.budget_text())
    workdir = Path(tempfile.mkdtemp(prefix=f"aitune-{backend.name}-"))
    step = None
    try:
        with (
            progress.step(f"{target.module_name}: build {candidate.label}") as step,
            torch.no_grad(),
            recording.bypass(),
        ):
            built = session.hook.aitune_build(
                backend=backend, module=target.module, context=target.build_context(workdir), session=session
            )
        candidate.backend = built if built is not None else backend
    except NotApplicableError as exc:  # by design, not a fault: no build-error observers
        candidate.report.build_time_s = step.seconds if step is not None else None
        return ledger.not_applicable(candidate, str(exc), exc)
    except Exception as exc:
        candidate.report.build_time_s = step.seconds if step is not None else None
        session.hook.aitune_build_error(
            module_name=target.module_name, graph=target.graph, backend=backend, error=exc, session=session
        )
        return ledger.fail(candidate, "build", f"{type(exc).__name__}: {exc}", exc)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if step is not None and step.seconds is not None:
            charge(ledger, candidate, step.seconds)
    candidate.report.build_time_s = step.seconds
    candidate.report.build_info = dict(candidate.backend.build_info)
    candidate.report.from_cache = bool(candidate.backend.build_info.get("from_cache", False))
    return candidate


def beside(target: Target, template: Backend) -> bool:
    """Whether ``template`` builds in a worker that runs beside the tune (a concurrent executor's
    build, sent ahead), so the process may build others meanwhile."""
    builds = target.session.builds
    return builds is not None and builds.beside(template)


def supersede(ledger: Ledger, template: Backend, by: Candidate) -> Candidate:
    """``template``'s candidate, recorded as not built: ``by`` runs what it would, with less per call."""
    return ledger.superseded(_entry(ledger, template), by)


def _entry(ledger: Ledger, template: Backend) -> Candidate:
    """A fresh copy of ``template`` with its pending report entry: its config, and its variant."""
    target = ledger.target
    backend = template.clone()
    try:
        config = target.session.registry.config_to_json(backend.config, backend.name)
    except (ConfigError, SerializationError):
        config = {"backend": backend.name}
    static = f"static batch {target.static_batch}" if target.static_batch is not None else None
    variant = ", ".join(filter(None, [backend.variant(), static])) or None
    candidate = Candidate(backend, ledger.add(backend.name, config, variant))
    ledger.built.append(candidate)
    return candidate


def charge(ledger: Ledger, candidate: Candidate, seconds: float) -> None:
    """Split a build step's seconds into the export, the wait for a build that ran elsewhere,
    and the build itself, as the backend (``export_s``) and the isolation (``wait_s``) state them.
    A build-cache hit only loaded: its stored figures are those of the build that made it."""
    info = {} if candidate.backend.build_info.get("from_cache") else candidate.backend.build_info
    export = _within(info.get(EXPORT_S), seconds)
    waiting = _within(info.get(WAIT_S), seconds - export)
    who = ledger.who(candidate)
    for stage, part in (("export", export), ("waiting", waiting), ("build", seconds - export - waiting)):
        if part or stage == "build":
            ledger.progress.charge(who, stage, part)


def order(templates: Sequence[Backend], progress: TuneProgress) -> list[Backend]:
    """With a time budget, the cheapest builds first (``Backend.build_cost``; ties keep their
    order, the priority given), so the budget is spent where it buys the most candidates."""
    if progress.time_budget is None:
        return list(templates)
    return sorted(templates, key=lambda b: b.build_cost)


def _within(value: Any, most: float) -> float:
    """A stated number of seconds, kept between 0 and ``most`` (0 when not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return 0.0
    return min(max(float(value), 0.0), max(most, 0.0))
