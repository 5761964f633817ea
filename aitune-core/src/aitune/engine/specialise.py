"""Static-shape builds per batch size, kept only where they beat the dynamic winner.

After a strategy has decided on dynamic builds, each profiled batch size whose winner can build
for one shape (:attr:`aitune.backend.Backend.builds_static`) gets a build of that backend for that
batch size alone. It is validated on calls of that size, then timed in one interleaved session
with the dynamic winner it would replace. It is kept only when it beats that winner by at least
``min_gain`` beyond the measured spread, the price of the memory, artifact size and load time it
adds (measured by writing and reading its payload as ``ait.save`` and ``ait.load`` would, and
shown in the report). A kept build serves calls of exactly its shapes; every other call goes to
the routes decided before, as without it.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from .. import payload
from ..backend import LoadContext
from ..cachedir import cache_dir
from ..graph import BATCH
from ..profiling import ProfilingConfig
from ..report import CandidateReport, CandidateStatus
from ..session import Session
from .figures import compare
from .graph_tuning import Candidate, GraphTuning, Route

Answer = Candidate | list[Route] | None


def specialise(
    tuning: GraphTuning, answer: Answer, measured: Sequence[int], config: ProfilingConfig, min_gain: float
) -> Answer:
    """``answer`` with a static-shape route in front for each batch size where one pays; else unchanged."""
    routes = _as_routes(tuning, answer)
    if routes is None:
        return answer
    kept: list[tuple[Route, str]] = []
    for size in measured:
        serving = next((r.candidate for r in routes if r.batch_min <= size <= r.batch_max), None)
        if serving is None or not serving.backend.builds_static:
            continue
        found = _try(tuning, serving, size, config, min_gain)
        if found is not None:
            kept.append(found)
    if not kept:
        return answer
    reason = tuning.report.reason or ""
    batch = tuning.report.selected_batch_size
    static = [route for route, _ in kept]
    tuning.finish_routes(static + routes, reason)
    tuning.report.selected_batch_size = batch
    tuning.note("static shapes: " + "; ".join(why for _, why in kept))
    return static + routes


def _why_not(tuning: GraphTuning) -> str | None:
    """Why this graph gets no static-shape builds, or None when it may."""
    graph = tuning.graph
    if graph.mutated:
        return "its inputs are updated in place (a KV cache): it is built as recorded"
    if graph.batch is None or graph.batch.min == graph.batch.max:
        return "its calls have one batch size, which its builds are made for already"
    varying = [f"{n} {r.min}..{r.max}" for n, r in graph.dims.items() if n != BATCH and r.min != r.max]
    if varying:
        return (
            f"axes other than the batch vary ({', '.join(varying)}), so a build per batch size would still be dynamic"
        )
    return None


def _as_routes(tuning: GraphTuning, answer: Answer) -> list[Route] | None:
    """The decision as batch-range routes; None when there is nothing to specialise."""
    if answer is None:  # eager serves every size
        return None
    why = _why_not(tuning)
    if why is not None:
        tuning.note(f"no static-shape builds: {why}")
        return None
    if isinstance(answer, list):
        return answer
    batch = tuning.graph.batch
    assert batch is not None
    return [Route(batch.min, batch.max, answer)]


def _try(
    tuning: GraphTuning, serving: Candidate, size: int, config: ProfilingConfig, min_gain: float
) -> tuple[Route, str] | None:
    """Build, check and time ``serving``'s backend for ``size`` alone; its route and why, when it pays."""
    pinned = tuning.pinned(size)
    variant = pinned.build(serving.backend)
    if not variant.ok or not pinned.validate(variant):
        return None
    # the dynamic winner again, in the same session: a paired figure, with a report entry of its own
    rival = Candidate(serving.backend, CandidateReport(serving.name, {}), reported=True)
    eager = list(tuning.report.eager_profiles)
    pinned.profile([rival, variant], config, True, [size])
    tuning.report.eager_profiles = eager  # the report's eager figures stay those the decision was made on
    mine, theirs = variant.profile_at(size), rival.profile_at(size)
    if not variant.ok or mine is None or theirs is None:
        return None
    cmp = compare(mine, theirs)
    versus = pinned.versus_eager(variant, size)
    if versus is not None:
        variant.report.speedup, variant.report.speedup_low = versus.speedup, versus.low_speedup
        variant.report.speedup_high, variant.report.measured = versus.high_speedup, versus.measured(config.max_noise)
    against = f"against the dynamic build at batch {size}"
    shown = cmp.describe(config.max_noise)
    figures = f"{shown} {against}" if cmp.measured(config.max_noise) else f"{against}, {shown}"
    bar = 1.0 + min_gain
    if cmp.low_speedup < bar:
        _reject(variant, f"{figures}; kept only from {bar:.2f}x beyond the spread (the price of its size and load)")
        return None
    cost = _cost(variant, pinned, tuning.session)
    if isinstance(cost, str):
        _reject(variant, f"{figures}, but {cost}")
        return None
    size_mb, load_s = cost
    calls = max(1, math.ceil(load_s * 1000 / (theirs.p50_ms - mine.p50_ms)))
    variant.report.reason = (
        f"{figures}; adds {size_mb:.2f} MB to the artifact and {load_s:.2f} s to ait.load, repaid after "
        f"{calls} call{'s' if calls != 1 else ''} of this size"
    )
    return Route(size, size, variant), f"{variant.name} for batch {size}: {variant.report.reason}"


def _reject(variant: Candidate, reason: str) -> None:
    variant.report.status = CandidateStatus.REJECTED
    variant.report.reason = reason


def _cost(variant: Candidate, tuning: GraphTuning, session: Session) -> tuple[float, float] | str:
    """The payload's size (MB) and the time to load it (s), written and read back as an artifact's
    would be; or why it cannot be (then ``ait.save`` could not keep it either)."""
    folder = Path(tempfile.mkdtemp(prefix="aitune-static-"))
    try:
        record = payload.write(variant.backend, folder, session)
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        context = LoadContext(tuning.graph, tuning.device, dict(record.metadata), cache_dir(), tuning.module_name)
        start = time.perf_counter()
        payload.read(attrs.evolve(record, files=None), folder, tuning.module, context, session, trust=True)
        return size / 1e6, time.perf_counter() - start
    except Exception as exc:
        return f"its payload cannot be saved and loaded back ({type(exc).__name__}: {exc})"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
