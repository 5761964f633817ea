"""Validate: a built candidate in, whether its outputs may stand in for eager's out.

The ``aitune_validate`` hook compares with eager PyTorch on every recorded call (within the
tolerances). With the user's metric (:class:`~aitune.engine.options.AccuracyRule`), the metric over
the recorded calls decides instead, so a candidate outside the numeric bound whose outputs have
eager's form (an int8 one) can pass, and its report says so. A candidate that does not pass is
marked failed at stage ``validate``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ...backend import Tolerance
from ...report import ValidationReport
from .. import recording
from ..options import AccuracyRule
from .candidate import Candidate
from .ledger import Ledger


class Validator:
    """Checks candidates of one target against eager, by the tolerances or by the user's metric."""

    def __init__(
        self,
        ledger: Ledger,
        tolerances: Mapping[str, Tolerance] | None,
        masked_by: str | None,
        accuracy: AccuracyRule,
    ) -> None:
        self.ledger = ledger
        self.tolerances = tolerances
        self.masked_by = masked_by
        """The input holding the attention mask when only unmasked positions are compared, else None."""
        self.accuracy = accuracy
        """The user's metric and accuracy budget; without a metric the numeric bound decides."""
        self._eager_outputs: list[Any] | None = None
        """Eager's outputs on the recorded calls, computed once per target for the metric."""

    def pinned(self, ledger: Ledger) -> Validator:
        """The same checks for a pinned target's ``ledger`` (eager's outputs are computed again, on its calls)."""
        return Validator(ledger, self.tolerances, self.masked_by, self.accuracy)

    def validate(self, candidate: Candidate) -> bool:
        """Compare with eager on every sample; a failure marks the candidate failed."""
        ledger, target = self.ledger, self.ledger.target
        what = f"{target.module_name}: validate {candidate.label}"
        with (
            ledger.progress.step(what, "validate", [ledger.who(candidate)]) as step,
            torch.no_grad(),
            recording.bypass(),
        ):
            result = target.session.hook.aitune_validate(
                backend=candidate.backend,
                reference=target.module,
                samples=target.samples,
                graph=target.graph,
                tolerances=self.tolerances,
                masked_by=self.masked_by,
                session=target.session,
            )
        candidate.report.validation = result
        candidate.report.validate_time_s = step.seconds
        if self.accuracy.metric is not None and (result.passed or result.closeness_only):
            reason = self.judge_by_metric(candidate, result)
            if reason is not None:
                ledger.fail(candidate, "validate", reason, None)
                return False
        elif not result.passed:  # the build cache drops a cached build that fails here (it observes the result)
            ledger.fail(candidate, "validate", result.reason or "outputs differ from eager", None)
            return False
        return True

    def judge_by_metric(self, candidate: Candidate, result: ValidationReport) -> str | None:
        """The user's metric over the recorded calls decides: why it rejects ``candidate``, or None.

        A candidate outside the numeric bound whose outputs have eager's form (an int8 one) is
        accepted when the metric holds, and ``result`` says so.
        """
        metric, floor = self.accuracy.metric, self.accuracy.floor
        assert metric is not None
        target = self.ledger.target
        values = []
        with torch.no_grad(), recording.bypass():
            if self._eager_outputs is None:  # once per target, whatever the number of candidates
                fresh = [s.fresh() for s in target.samples]
                self._eager_outputs = [target.module(*s.args, **s.kwargs) for s in fresh]
            for sample, eager in zip(target.samples, self._eager_outputs):
                mine = sample.fresh()
                tuned = candidate.backend.infer(*mine.args, **mine.kwargs)
                values.append(float(metric(tuned, eager, sample)))
        value = sum(values) / len(values) if values else 1.0
        candidate.report.metric = value
        if not math.isfinite(value):
            return f"the metric returned {value} for some recorded call, which measures nothing, so the candidate fails"
        if value < floor:
            return f"the metric is {value:.4g} over the recorded calls, below {floor:.4g} (1 - accuracy_budget)"
        if not result.passed:
            result.checks.append(f"outside the numeric bound ({result.reason}); accepted by the metric ({value:.4g})")
            result.passed, result.reason = True, None
        return None
