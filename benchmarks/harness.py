"""The benchmark run: per case, the oracle (each backend alone), the strategies, tune times,
cold starts; then the per-call overhead on a tiny model. Everything lands in one JSON document."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from . import models, report
from .measure import interleaved, spread
from .models import CASES, TINY, Case, fastpath
from .tuning import available_backends, make_strategy, oracle_strategy, tune

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def machine(args: Any) -> dict[str, Any]:
    from aitune.machine import environment

    env = environment(torch.device(args.device))
    env.update(
        cores=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        interop_threads=torch.get_num_interop_threads(),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS"),
        OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "unset"),
        python=platform.python_version(),
    )
    return env


def run(args: Any) -> int:
    if args.list:
        for c in CASES.values():
            print(f"{c.name:16} {c.note}")
        return 0
    torch.set_num_threads(args.threads)
    cases = [models.get(n) for n in args.models.split(",")] if args.models else list(CASES.values())
    usable, skipped = available_backends(args.device)
    if args.backends:
        wanted = args.backends.split(",")
        skipped = {n: r for n, r in skipped.items() if n in wanted}
        skipped.update({n: "not installed" for n in wanted if n not in usable and n not in skipped})
        usable = [n for n in usable if n in wanted]
    results: dict[str, Any] = {
        "machine": machine(args),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "markdown", "list")},
        "backends": usable,
        "skipped_backends": skipped,
        "cases": [],
    }
    for name, reason in skipped.items():
        log(f"backend {name} skipped: {reason}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="aitune-bench-") as tmp:
        for case in cases:
            log(f"case {case.name}")
            results["cases"].append(run_case(case, usable, args, Path(tmp)))
        results["overhead"] = per_call_overhead(usable, args, Path(tmp))
    results["duration_s"] = time.perf_counter() - started
    text = report.markdown(results)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
        log(f"wrote {args.out}")
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


def fresh_cache(tmp: Path, label: str) -> str:
    """Point aitune's cache (build cache and Inductor's disk cache) at an empty folder."""
    path = tempfile.mkdtemp(prefix=f"cache-{label}-", dir=tmp)
    os.environ["AITUNE_CACHE_DIR"] = path
    return path


def run_case(case: Case, backends: list[str], args: Any, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"case": case.name, "note": case.note, "oracle": {}, "strategies": {}, "batches": []}
    base = case.build(args.device)
    largest = case.inputs(max(args.batch_sizes), args.device)
    with fastpath(case.fastpath):
        eager_ms = interleaved({"eager": lambda: base(largest)}, args.steps, 3)["eager"]["median"]
    budget_ms = 1.25 * eager_ms
    out["latency_budget_ms"] = budget_ms
    fresh_cache(tmp, case.name)

    oracle: dict[str, Any] = {}
    for name in backends:
        log(f"  {case.name}: {name} alone")
        tuned = tune(case, oracle_strategy(name, args.threads), args.batch_sizes, args.device, base)
        oracle[name] = tuned
        out["oracle"][name] = candidate_figures(tuned, name)
    strategies: dict[str, Any] = {}
    for name in args.strategies:
        log(f"  {case.name}: {name}")
        strategy = make_strategy(name, backends, args.threads, args.quick, args.batch_sizes, budget_ms)
        tuned = tune(case, strategy, args.batch_sizes, args.device, base)
        strategies[name] = tuned
        out["strategies"][name] = {
            "decisions": tuned.decisions,
            "error": tuned.error,
            "tune_s_build_cache_warm": tuned.wall_s,
            "reasons": [g.reason for m in tuned.report.modules for g in m.graphs] if tuned.report else [],
            "candidates": [
                {
                    "module": m.name,
                    "backend": c.backend,
                    "status": c.status,
                    "reason": c.reason,
                    "p50_ms": {p.batch_size: p.p50_ms for p in c.profiles},
                }
                for m in (tuned.report.modules if tuned.report else [])
                for g in m.graphs
                for c in g.candidates
            ],
        }

    with fastpath(case.fastpath):
        for batch in args.batch_sizes:
            log(f"  {case.name}: measuring batch {batch}")
            out["batches"].append(measure_batch(case, base, oracle, strategies, batch, args))
    if case.name in args.tune_time_models:
        out["tune_time"] = tune_times(case, backends, args, tmp, budget_ms)
    if case.name in args.cold_start_models:
        out["cold_start"] = cold_starts(case, base, oracle, out, args, tmp)
    return out


def candidate_figures(tuned: Any, backend: str) -> dict[str, Any]:
    """Build time and accuracy of one backend alone, from its tuning report."""
    if tuned.report is None or tuned.error:
        return {"ok": False, "error": tuned.error}
    figures: dict[str, Any] = {"ok": True, "tune_s": tuned.wall_s, "build_s": 0.0, "modules": {}}
    for m in tuned.report.modules:
        for g in m.graphs:
            for c in g.candidates:
                if c.backend != backend:
                    continue
                figures["build_s"] += c.build_time_s or 0.0
                v = c.validation
                figures["modules"][m.name] = {
                    "max_rel_error": v.max_rel_error if v else None,
                    "max_abs_error": max((o.max_abs_error for o in v.outputs), default=0.0) if v else None,
                    "cosine": v.min_cosine if v else None,
                    "from_cache": c.from_cache,
                    "build_info": c.build_info,
                }
    return figures


def measure_batch(
    case: Case, base: Any, oracle: dict[str, Any], strategies: dict[str, Any], batch: int, args: Any
) -> dict[str, Any]:
    x = case.inputs(batch, args.device)

    def call(model: Any) -> Any:
        return lambda: model(x)

    contenders = {"eager": call(base)}
    contenders.update({f"backend:{n}": call(t.model) for n, t in oracle.items() if t.model is not None and not t.error})
    contenders.update({f"strategy:{n}": call(t.model) for n, t in strategies.items() if t.model is not None})
    stats = interleaved(contenders, args.steps, args.repeats, cuda=args.device.startswith("cuda"))
    eager = stats["eager"]["median"]
    for s in stats.values():
        s["speedup"] = eager / s["median"]
    alone = {k.split(":", 1)[1]: v for k, v in stats.items() if k.startswith("backend:")}
    alone["torch_eager"] = stats["eager"]
    best = min(alone, key=lambda n: alone[n]["median"])
    picks = {}
    for name, tuned in strategies.items():
        s = stats.get(f"strategy:{name}")
        if name == "min_latency" and batch != 1:
            continue  # it optimizes batch 1 only; judging it elsewhere would be unfair
        if s is None:
            picks[name] = {"error": tuned.error}
            continue
        picks[name] = {
            "decisions": tuned.decisions,
            "picked_best": bool(tuned.decisions) and all(d == best for d in tuned.decisions),
            "miss": s["median"] / alone[best]["median"] - 1.0,
            # the tuned model's quartiles reach the fastest contender's: not slower beyond the spread
            "within_spread": s["q1"] <= alone[best]["q3"],
            "slower_than_eager": s["q1"] > stats["eager"]["q3"],
        }
    return {"batch": batch, "stats": stats, "oracle_best": best, "picks": picks}


def child(kind: str, spec: dict[str, Any], env: dict[str, str] | None = None) -> tuple[float, dict[str, Any]]:
    """Run ``benchmarks.child`` in a fresh interpreter; the parent's clock is the figure."""
    cmd = [sys.executable, "-m", "benchmarks.child", kind, json.dumps(spec)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH-RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{kind} child failed (rc {proc.returncode}): {' | '.join(tail)}")
    return wall, json.loads(line.removeprefix("BENCH-RESULT "))


def tune_times(case: Case, backends: list[str], args: Any, tmp: Path, budget_ms: float) -> dict[str, Any]:
    """Per strategy, in a fresh process with an empty cache: the first tune, then the same tune again."""
    out: dict[str, Any] = {}
    names = args.strategies if not args.quick else [s for s in args.strategies if s == "max_throughput"]
    for name in names:
        log(f"  {case.name}: cold and warm tune, {name} (fresh process)")
        spec = {
            "case": case.name, "strategy": name, "backends": backends, "threads": args.threads, "quick": args.quick,
            "batch_sizes": args.batch_sizes, "budget_ms": budget_ms, "device": args.device,
        }  # fmt: skip
        cache = tempfile.mkdtemp(prefix="tunetime-", dir=tmp)
        try:
            wall, result = child("tune_time", spec, {"AITUNE_CACHE_DIR": cache})
            out[name] = {**result, "process_s": wall}
        except RuntimeError as exc:
            out[name] = {"error": str(exc)}
    return out


def cold_starts(
    case: Case, base: Any, oracle: dict[str, Any], figures: dict[str, Any], args: Any, tmp: Path
) -> dict[str, Any]:
    """Fresh process to first output: ait.load of an artifact, eager, torch.compile with a cold and a warm cache."""
    from safetensors.torch import save_file

    import aitune.torch as ait

    weights = tmp / f"{case.name}.safetensors"
    save_file({k: v.detach().contiguous().clone() for k, v in base.state_dict().items()}, str(weights))
    built = [n for n, t in oracle.items() if t.model is not None and not t.error]
    if args.quick and built:  # one artifact: the backend the oracle found fastest at the largest batch
        last = figures["batches"][-1]
        ranked = sorted(built, key=lambda n: last["stats"][f"backend:{n}"]["median"])
        built = ranked[:1]
    spec = {"case": case.name, "device": args.device, "weights": str(weights)}
    contenders: dict[str, tuple[str, dict[str, Any], dict[str, str]]] = {
        "eager": ("eager", spec, {}),
        "torch.compile (empty Inductor cache)": ("compile", spec, {}),
    }
    if not args.quick:
        warm = {"TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor")}
        contenders["torch.compile (warm Inductor cache)"] = ("compile", spec, warm)
        try:
            child("compile", spec, warm)  # fills the warm cache, unmeasured
        except RuntimeError as exc:
            log(f"  warming the Inductor cache failed: {exc}")
    for name in built:
        path = tmp / f"{case.name}-{name}.ait"
        ait.save(oracle[name].model, path)
        contenders[f"ait.load ({name})"] = ("aitune", {**spec, "artifact": str(path)}, {})
        if not args.quick:  # what ait.load's check against eager (on for unpinned artifacts) costs
            contenders[f"ait.load ({name}, check=False)"] = (
                "aitune",
                {**spec, "artifact": str(path), "check": False},
                {},
            )
    log(f"  {case.name}: cold starts of {len(contenders)} contenders x {args.cold_start_repeats}")
    walls: dict[str, list[float]] = {n: [] for n in contenders}
    phases: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    names = list(contenders)
    for r in range(args.cold_start_repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name in errors:
                continue
            kind, cspec, env = contenders[name]
            env = {"AITUNE_CACHE_DIR": tempfile.mkdtemp(dir=tmp), "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(dir=tmp),
                   **env}  # fmt: skip
            try:
                wall, inside = child(kind, cspec, env)
            except RuntimeError as exc:
                errors[name] = str(exc)
                continue
            walls[name].append(wall)
            phases[name] = inside
    return {
        n: {"wall_s": spread(w), "last_phases": phases.get(n)} if w else {"error": errors.get(n)}
        for n, w in walls.items()
    }


def per_call_overhead(backends: list[str], args: Any, tmp: Path) -> dict[str, Any]:
    """What an ``ait.Module`` call costs over calling the winning backend directly, on a tiny model."""
    fresh_cache(tmp, "tiny")
    chosen = backends
    if args.quick:
        chosen = [b for b in ("onnxruntime", "torch_inductor_aot") if b in backends][:1] or backends[:1]
    base = TINY.build(args.device)
    x = TINY.inputs(1, args.device)
    out: dict[str, Any] = {}
    for name in chosen:
        log(f"overhead: {name}")
        tuned = tune(TINY, oracle_strategy(name, args.threads), [1], args.device, base)
        if tuned.error or tuned.model is None or not tuned.model.tuned_graphs:
            out[name] = {"error": tuned.error or "nothing tuned"}
            continue
        infer = tuned.model.tuned_graphs[0][1].infer
        model = tuned.model
        stats = interleaved(
            {"eager": lambda: base(x), "direct": lambda: infer(x), "ait.Module": lambda: model(x)},  # noqa: B023
            steps=args.steps * 20,
            repeats=args.repeats,
        )
        us = {k: v["median"] * 1e3 for k, v in stats.items()}
        out[name] = {
            "us": us,
            "iqr_us": {k: (v["q1"] * 1e3, v["q3"] * 1e3) for k, v in stats.items()},
            "overhead_us": us["ait.Module"] - us["direct"],
        }
    return out
