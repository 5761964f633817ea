"""What the steps of graph tuning pass along: a candidate (one backend built for one graph) and a route."""

from __future__ import annotations

import attrs

from ...backend import Backend
from ...report import CandidateReport, CandidateStatus, ProfileResult

NOT_BUILT = (
    CandidateStatus.FAILED,
    CandidateStatus.NOT_APPLICABLE,
    CandidateStatus.SKIPPED,
    CandidateStatus.SUPERSEDED,
)
"""Statuses of a candidate with nothing usable built."""


@attrs.define(eq=False)
class Candidate:
    """One backend for one graph: the built object (if it built) and its report entry."""

    backend: Backend
    report: CandidateReport
    error: BaseException | None = None
    reported: bool = False
    """Observers have heard its result (``aitune_candidate_result`` fires once per candidate); eager's
    own candidate starts reported, since observers hear only of the candidates built."""

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def static_batch(self) -> int | None:
        """The one batch size it was built for (static shapes, see :meth:`GraphTuning.pinned`), else None."""
        return self.report.static_batch

    @property
    def ok(self) -> bool:
        return self.error is None and self.report.status not in NOT_BUILT

    @property
    def label(self) -> str:
        """``onnxruntime (torchscript export)``: the backend and, when it has several, its variant."""
        return self.report.label

    def profile_at(self, batch_size: int) -> ProfileResult | None:
        return next((p for p in self.report.profiles if p.batch_size == batch_size), None)


@attrs.frozen
class Route:
    """One batch range of a graph and the candidate that serves it (None: eager)."""

    batch_min: int
    batch_max: int
    candidate: Candidate | None
