"""Decide: how a strategy's decision is written into the graph's report, and the figures it reads.

A strategy (:mod:`..strategies`) applies its rule to the profiled candidates; what it decides is
recorded here, the same way for every strategy: one winner (or eager) with :func:`finish`, one per
batch range with :func:`finish_routes`, and the figures the report shows next to every candidate
with :func:`annotate`. A candidate still pending when the decision is made is rejected, and
observers hear of every candidate not yet reported.
"""

from __future__ import annotations

from ...report import CandidateStatus, GraphReport, ProfileResult, RouteReport
from ..figures import Comparison, compare
from .candidate import Candidate, Route
from .ledger import Ledger


def finish(ledger: Ledger, eager: Candidate, candidate: Candidate | None, reason: str, batch_size: int | None) -> None:
    """Record the decision: ``candidate`` wins (eager when None, or eager's own candidate) at ``batch_size``."""
    report = ledger.report
    for c in report.candidates:
        if c.status == "pending":
            c.status = CandidateStatus.REJECTED
    if candidate is not None and candidate is not eager:
        candidate.report.status = CandidateStatus.SELECTED
    report.decision = candidate.name if candidate is not None else "torch_eager"
    report.reason = reason
    report.selected_batch_size = batch_size
    for built in ledger.built:
        ledger.complete(built)


def finish_routes(ledger: Ledger, eager: Candidate, routes: list[Route], reason: str) -> None:
    """Record a decision that serves batch ranges with different candidates (None: eager)."""
    report = ledger.report
    for route in routes:
        if route.candidate is not None:
            route.candidate.report.status = CandidateStatus.SELECTED
    report.routes = [
        RouteReport(
            r.batch_min,
            r.batch_max,
            r.candidate.name if r.candidate else "torch_eager",
            static=r.candidate is not None and r.candidate.static_batch is not None,
            variant=r.candidate.report.variant if r.candidate else None,
        )
        for r in routes
    ]
    finish(ledger, eager, None, reason, None)
    # by label: two variants of one backend may serve two ranges
    report.decision = ", ".join(f"{r.label} (batch {r.batch_min}..{r.batch_max})" for r in report.routes)


def annotate(ledger: Ledger, batch_size: int | None, max_noise: float) -> None:
    """Write every candidate's speedup and interval at ``batch_size``: the figures the report shows."""
    for c in ledger.built:
        cmp = versus_eager(ledger.report, c, batch_size) if batch_size is not None else None
        c.report.speedup = cmp.speedup if cmp else None
        c.report.speedup_low = cmp.low_speedup if cmp else None
        c.report.speedup_high = cmp.high_speedup if cmp else None
        c.report.measured = cmp.measured(max_noise) if cmp else None


def versus_eager(report: GraphReport, candidate: Candidate, batch_size: int) -> Comparison | None:
    """``candidate`` against the eager windows of its own profiling round at ``batch_size``."""
    mine = candidate.profile_at(batch_size)
    if mine is None:
        return None
    if mine.baseline_p50_ms is None:
        eager = eager_profile(report, batch_size)
        return compare(mine, eager) if eager is not None else None
    return compare(mine)


def eager_profile(report: GraphReport, batch_size: int) -> ProfileResult | None:
    """Eager's timing at ``batch_size`` as the report keeps it (the latest round's)."""
    return next((p for p in report.eager_profiles if p.batch_size == batch_size), None)


def failures(report: GraphReport) -> str:
    """``backend: reason`` of every candidate that failed, joined, then those skipped for the time
    budget; not applicable ones are left out (the detailed report lists them)."""
    parts = [
        f"{c.backend}{f' ({c.variant})' if c.variant else ''}: {c.reason}"
        for c in report.candidates
        if c.status == CandidateStatus.FAILED
    ]
    skipped = [c.backend for c in report.candidates if c.status == CandidateStatus.SKIPPED]
    if skipped:
        parts.append(f"{', '.join(skipped)} skipped: the time budget was spent")
    return "; ".join(parts)
