"""Ready-made accuracy metrics for ``ait.tune(..., metric=..., accuracy_budget=...)``.

A metric is ``fn(tuned_outputs, eager_outputs, batch) -> float`` where 1.0 means the candidate
answered as eager did; a candidate is accepted when the metric's mean over the recorded calls is at
least ``1 - accuracy_budget`` (``accuracy_budget=0.005``: top-1 agreement of 99.5% or better).
Outputs may be any structure aitune handles: these metrics read its tensors in order.
"""

from __future__ import annotations

from typing import Any

import torch

from . import tree


def _leaves(outputs: Any) -> list[torch.Tensor]:
    return [t for t in tree.flatten(outputs)[0] if t.is_floating_point()]


def top1_agreement(tuned: Any, eager: Any, batch: Any = None) -> float:
    """The share of rows whose argmax over the last axis of the first output (the logits) agrees."""
    mine, theirs = _leaves(tuned)[0], _leaves(eager)[0]
    return float((mine.argmax(-1) == theirs.argmax(-1)).float().mean())


def cosine_similarity(tuned: Any, eager: Any, batch: Any = None) -> float:
    """The lowest cosine similarity of any floating output with eager's (embeddings, hidden states)."""
    pairs = zip(_leaves(tuned), _leaves(eager))
    return min(
        (
            float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))
            for a, b in pairs
        ),
        default=1.0,
    )


def relative_accuracy(tuned: Any, eager: Any, batch: Any = None) -> float:
    """1 minus the largest error of any floating output, relative to that output's scale.

    A NaN or infinity where eager has a finite number scores 0.0 (no agreement), and an output
    eager answered with all zeros is scored by its absolute error, so a candidate cannot reach 1.0
    by answering garbage where the scale is zero.
    """
    worst = 0.0
    for a, b in zip(_leaves(tuned), _leaves(eager)):
        if b.numel() == 0:
            continue
        a, b = a.double(), b.double().to(a.device)
        if a.shape != b.shape:
            return 0.0
        finite = torch.isfinite(b)
        same = (a == b) | (a.isnan() & b.isnan())
        if not bool(torch.isfinite(a)[finite].all()) or not bool(same[~finite].all()):
            return 0.0  # a NaN or infinity where eager has none, or another one than eager's
        if not bool(finite.any()):
            continue
        error = float((a[finite] - b[finite]).abs().max())
        scale = float(b[finite].abs().max())
        worst = max(worst, error / scale if scale > 0 else error)
    return max(0.0, 1.0 - worst)


__all__ = ["cosine_similarity", "relative_accuracy", "top1_agreement"]
