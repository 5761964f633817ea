"""The rows both renderers show, computed once."""

from __future__ import annotations

from typing import Any

from ..report import CandidateReport, CandidateStatus, GraphReport, ModuleReport, TuneReport

CANDIDATE_COLUMNS = (
    "backend",
    "status",
    "build s",
    "validate s",
    "profile s",
    "cached",
    "max rel err",
    "cosine",
    "p50 ms",
    "p99 ms",
    "samples/s",
    "speedup",
    "reason",
)
"""``samples/s`` is batch over p50 and ``speedup`` is eager's p50 over the candidate's, measured in
one interleaved session, with the interval of the per-window ratios: the figure decisions use
("not measured: noise ±N%" when that interval is wider than the profiling config's ``max_noise``)."""


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _profile_at(candidate: CandidateReport, batch: int | None) -> Any:
    if not candidate.profiles:
        return None
    if batch is not None:
        for p in candidate.profiles:
            if p.batch_size == batch:
                return p
    return max(candidate.profiles, key=lambda p: p.throughput)


def candidate_rows(graph: GraphReport) -> list[list[str]]:
    rows = []
    eager = CandidateReport(
        "torch_eager (baseline)", {}, status=CandidateStatus.BASELINE, profiles=graph.eager_profiles
    )
    for c in [*graph.candidates, *([eager] if graph.eager_profiles else [])]:
        p = _profile_at(c, graph.selected_batch_size)
        v = c.validation
        rows.append(
            [
                c.label,
                c.status if not c.stage else f"{c.status} ({c.stage})",
                _fmt(c.build_time_s, ".2f"),
                _fmt(c.validate_time_s, ".2f"),
                _fmt(c.profile_time_s, ".2f"),
                "yes" if c.from_cache else "",
                _fmt(v.max_rel_error if v and v.outputs else None, ".1e"),
                _fmt(v.min_cosine if v and v.outputs else None, ".6f"),
                _fmt(p.p50_ms if p else None, ".3g"),
                _fmt(p.p99_ms if p else None, ".3g"),
                _fmt(p.throughput if p else None, ".1f"),
                c.speedup_text(),
                c.reason or "",
            ]
        )
    return rows


def graph_notes(graph: GraphReport) -> list[str]:
    """What was timed and what a reader should know about the figures, one line each."""
    lines = [f"timed: {line}" for line in graph.profiled_inputs]
    return lines + [f"note: {n}" for n in graph.notes]


def graph_inputs(graph: GraphReport) -> str:
    spec = graph.graph
    dims = spec.get("dims", {})
    parts = []
    for t in spec.get("inputs", []):
        shape = ", ".join(d if d else str(s) for s, d in zip(t["shape"], t["dims"]))
        parts.append(f"{t['path']}: {t['dtype']}[{shape}]")
    ranges = ", ".join(f"{n} {r['min']}..{r['max']} (opt {r['opt']})" for n, r in dims.items())
    return "; ".join(parts) + (f" with {ranges}" if ranges else "")


def headline(report: TuneReport) -> list[tuple[str, str]]:
    env = report.environment
    e2e = report.end_to_end
    rows = [
        ("failed", failures(report)),
        ("end to end", e2e.describe() if e2e is not None else ""),
        ("time shares", _shares(e2e.shares) if e2e is not None else ""),
        ("changed", "; ".join(report.changes)),
        ("aitune", report.aitune_version),
        ("started", report.started_at),
        ("duration", f"{report.duration_s:.1f} s" if report.duration_s else ""),
        ("time spent", time_spent(report)),
        ("time by candidate", time_by_candidate(report)),
        ("device", report.device),
        ("machine", str(env.get("gpu") or env.get("cpu", ""))),
        ("torch", str(env.get("torch", ""))),
        ("threads", _threads(env)),
        ("ranks", _ranks(env)),
        ("python", str(env.get("python", ""))),
        ("load average", _load(env)),
    ]
    return [(k, v) for k, v in rows if v]  # a report read back from an artifact has no run times


def time_spent(report: TuneReport) -> str:
    """``build 41.2 s, profile 12.0 s, ...`` largest first, with the budget when there was one."""
    parts = [f"{stage} {s:.1f} s" for stage, s in sorted(report.time_spent.items(), key=lambda kv: -kv[1]) if s]
    text = ", ".join(parts)
    if report.time_budget is not None:
        skipped = sum(c.status == "skipped" for m in report.modules for g in m.graphs for c in g.candidates)
        text += f" (time budget {report.time_budget:g} s" + (f", {skipped} candidate(s) skipped)" if skipped else ")")
    return text


def time_by_candidate(report: TuneReport) -> str:
    """``m: onnxruntime 9.2 s (export 3.1, build 2.0, validate 1.1, profile 3.0); ...`` largest first."""
    totals = sorted(report.time_by_candidate.items(), key=lambda kv: -sum(kv[1].values()))
    parts = []
    for who, stages in totals:
        inside = ", ".join(f"{stage} {s:.1f}" for stage, s in stages.items() if s >= 0.05)
        parts.append(f"{who} {sum(stages.values()):.1f} s" + (f" ({inside})" if inside else ""))
    return "; ".join(parts)


def failures(report: TuneReport) -> str:
    """The modules whose tuning failed (they run eager, no speed-up), with why: what a report leads with."""
    failed = [m for m in report.modules if m.status == "failed"]
    if not failed:
        return ""
    return f"{len(failed)} module(s) failed to tune and run eager: " + "; ".join(
        f"{m.name} ({m.error})" for m in failed
    )


def _shares(shares: dict[str, float]) -> str:
    """Each module's share of the eager time: the most tuning it can save (Amdahl)."""
    return ", ".join(f"{name} {share:.0%}" for name, share in sorted(shares.items(), key=lambda kv: -kv[1]))


def _load(env: dict[str, Any]) -> str:
    start, end = env.get("load_average_start"), env.get("load_average_end")
    if not start and not end:
        return ""
    show = lambda v: "/".join(f"{x:.2f}" for x in v) if v else "unknown"  # noqa: E731
    return f"{show(start)} at the start, {show(end)} at the end (1/5/15 min)"


def _threads(env: dict[str, Any]) -> str:
    if "threads" not in env:
        return ""
    text = f"{env['threads']} intra-op"
    if "interop_threads" in env:
        text += f", {env['interop_threads']} inter-op"
    if "omp_wait_policy" in env:
        text += f", OMP_WAIT_POLICY {env['omp_wait_policy']}"
    return text


def _ranks(env: dict[str, Any]) -> str:
    """Which rank's report this is, and whose figures the decisions rest on."""
    ranks = env.get("distributed")
    if not ranks:
        return ""
    who = "the slowest rank's figures" if ranks.get("decided_by") == "slowest" else "rank 0's figures"
    return f"rank {ranks['rank']} of {ranks['world_size']}, decided on {who}"


def module_status(module: ModuleReport) -> str:
    return module.summary or f"{module.name}: {module.status}"
