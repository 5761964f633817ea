"""Side-by-side timing: contenders take turns (round-robin, rotated), so drift hits them alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and range of repeated measurements."""
    s = sorted(values)
    q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive") if len(s) >= 2 else (s[0], s[0], s[0])
    return {"median": statistics.median(s), "q1": q1, "q3": q3, "min": s[0], "max": s[-1], "n": len(s)}


def interleaved(
    contenders: Mapping[str, Callable[[], Any]], steps: int, repeats: int, warmup: int = 3, cuda: bool = False
) -> dict[str, dict[str, float]]:
    """Milliseconds per call of each contender: per round, the mean of ``steps`` calls; then the spread over rounds."""
    names = list(contenders)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.no_grad():
        for name in names:
            for _ in range(warmup):
                contenders[name]()
        sync()
        rounds: dict[str, list[float]] = {n: [] for n in names}
        for r in range(repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                fn = contenders[name]
                start = time.perf_counter()
                for _ in range(steps):
                    fn()
                sync()
                rounds[name].append((time.perf_counter() - start) * 1e3 / steps)
    return {n: spread(v) for n, v in rounds.items()}
