"""The graph's report as the steps fill it: every candidate's entry, and observers told of each once.

Each step writes into the candidate's report entry as it happens. Observers
(``aitune_candidate_result``) hear about a candidate as soon as it is complete: when it fails or is
skipped (at any step), when it has been profiled, or, for a correct candidate never profiled, when
the graph's decision is made.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs

from ...report import CandidateReport, CandidateStatus, GraphReport
from ..progress import TuneProgress
from .candidate import Candidate
from .target import Target

logger = logging.getLogger("aitune")


@attrs.define(eq=False)
class Ledger:
    """The report of one graph, the candidates built for it, and the clock their seconds go on."""

    target: Target
    report: GraphReport
    progress: TuneProgress
    built: list[Candidate] = attrs.field(factory=list)
    """Every candidate built for this target, in order (their report entries are in ``report``)."""

    def sharing(self, target: Target) -> Ledger:
        """A ledger for ``target`` (a pinned one) that writes into this one's report and clock; its own
        candidates are listed apart, since the graph's decision is made over this one's."""
        return Ledger(target, self.report, self.progress)

    def add(self, backend_name: str, config: dict[str, Any], variant: str | None) -> CandidateReport:
        """A new pending entry in the report, for a candidate about to be built."""
        entry = CandidateReport(backend_name, config, variant=variant, static_batch=self.target.static_batch)
        self.report.candidates.append(entry)
        return entry

    def reorder(self, candidates: Sequence[Candidate]) -> None:
        """List ``candidates``' report entries in this order, in the places they hold: the report
        follows the strategy's order of candidates, not the order they were built in."""
        mine = {id(c.report) for c in candidates}
        slots = [i for i, entry in enumerate(self.report.candidates) if id(entry) in mine]
        for i, candidate in zip(slots, candidates):
            self.report.candidates[i] = candidate.report

    def who(self, candidate: Candidate) -> str:
        """Whom the report's time breakdown charges ``candidate``'s seconds to: ``module: backend (variant)``."""
        return f"{self.target.module_name}: {candidate.label}"

    def note(self, text: str) -> None:
        """A line for the graph's notes, once."""
        if text not in self.report.notes:
            self.report.notes.append(text)

    def fail(self, candidate: Candidate, stage: str, reason: str, error: BaseException | None) -> Candidate:
        """``candidate`` failed at ``stage`` (``availability``, ``build``, ``validate``, ``profile``)."""
        candidate.report.status = CandidateStatus.FAILED
        candidate.report.stage = stage
        candidate.report.reason = reason
        candidate.error = error
        logger.info("%s: %s failed at %s: %s", self.target.module_name, candidate.name, stage, reason)
        self.complete(candidate)
        return candidate

    def skip(self, candidate: Candidate, reason: str) -> Candidate:
        """``candidate`` was not built (the time budget was spent)."""
        candidate.report.status = CandidateStatus.SKIPPED
        candidate.report.reason = reason
        logger.info("%s: %s skipped: %s", self.target.module_name, candidate.label, reason)
        self.complete(candidate)
        return candidate

    def superseded(self, candidate: Candidate, by: Candidate) -> Candidate:
        """``candidate`` was not built: ``by`` runs what it would, with less per call, and is correct."""
        candidate.report.status = CandidateStatus.SUPERSEDED
        candidate.report.reason = (
            f"not built: {by.label} built and passed validation, and runs the same compiled code with less "
            "work per call; list the backends in the strategy to build both"
        )
        logger.info("%s: %s superseded by %s", self.target.module_name, candidate.label, by.label)
        self.complete(candidate)
        return candidate

    def not_applicable(self, candidate: Candidate, reason: str, error: BaseException) -> Candidate:
        """``candidate``'s backend does not apply to this module: by design, not a fault."""
        candidate.report.status = CandidateStatus.NOT_APPLICABLE
        candidate.report.stage = "build"
        candidate.report.reason = reason
        candidate.error = error
        logger.info("%s: %s does not apply: %s", self.target.module_name, candidate.name, reason)
        self.complete(candidate)
        return candidate

    def complete(self, candidate: Candidate) -> None:
        """Tell observers ``candidate``'s result, once: its status is ``failed``, or still ``pending``
        (complete, awaiting the graph's decision) unless the decision is made already."""
        if candidate.reported:
            return
        candidate.reported = True
        self.target.session.hook.aitune_candidate_result(
            module_name=self.target.module_name,
            graph=self.target.graph,
            candidate=candidate.report,
            session=self.target.session,
        )
