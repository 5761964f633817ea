"""The results as markdown tables: what a person reads; the JSON holds everything else."""

from __future__ import annotations

from typing import Any

SHORT = {
    "torch_eager": "eager",
    "torch_inductor_jit": "inductor-jit",
    "torch_inductor_aot": "inductor-aot",
    "onnxruntime": "ort",
    "torchao": "torchao",
}


def short(name: str) -> str:
    return SHORT.get(name, name)


def ms(s: dict[str, float]) -> str:
    return f"{s['median']:.3g} ({s['q1']:.3g}–{s['q3']:.3g})"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(r: dict[str, Any]) -> str:
    m, st = r["machine"], r["settings"]
    out = [
        f"**{m.get('gpu') or m['cpu']}**, {m['cores']} cores; torch {m['torch']} ({st['device']}), "
        f"{m['torch_threads']} torch thread(s), OMP_NUM_THREADS={m['OMP_NUM_THREADS']}, "
        f"OMP_WAIT_POLICY={m['OMP_WAIT_POLICY']}; python {m['python']}; "
        f"{'quick' if st['quick'] else 'full'} run: {st['repeats']} rounds x {st['steps']} calls, "
        f"batch sizes {st['batch_sizes']}; {r.get('duration_s', 0):.0f} s in all.",
        "",
        "Latency is ms per call: median over rounds (interquartile range); speedup is eager median / median. "
        "Contenders run round-robin in one process.",
    ]
    if r["skipped_backends"]:
        out += ["", "Skipped backends: " + "; ".join(f"`{n}`: {why}" for n, why in r["skipped_backends"].items())]
    backends = r["backends"]

    rows = []
    for c in r["cases"]:
        for b in c["batches"]:
            s = b["stats"]
            row = [c["case"], str(b["batch"]), ms(s["eager"])]
            for n in backends:
                x = s.get(f"backend:{n}")
                row.append(f"{x['speedup']:.2f}x" if x else "failed")
            row.append(short(b["oracle_best"]))
            rows.append(row)
    out += ["", "### Each backend alone (the oracle)", "",
            table(["case", "batch", "eager ms", *(short(n) for n in backends), "fastest"], rows)]  # fmt: skip
    failures = [
        f"- {c['case']} / {short(n)}: {f['error']}" for c in r["cases"] for n, f in c["oracle"].items() if not f["ok"]
    ]
    if failures:
        out += ["", "Backends that failed alone:", *failures]

    rows = []
    met: dict[str, list[int]] = {}
    for c in r["cases"]:
        for b in c["batches"]:
            for name, p in b["picks"].items():
                if "error" in p:
                    rows.append([c["case"], str(b["batch"]), name, "error", "", "", p["error"] or ""])
                    continue
                s = b["stats"][f"strategy:{name}"]
                ok = p["picked_best"] or p.get("within_spread", False)
                counts = met.setdefault(name, [0, 0, 0])
                counts[0] += ok
                counts[1] += 1
                counts[2] += bool(p.get("slower_than_eager"))
                if p["picked_best"]:
                    verdict = "yes"
                elif p.get("within_spread"):
                    verdict = f"within the spread ({p['miss'] * 100:+.0f}%)"
                else:
                    verdict = f"no, {p['miss'] * 100:+.0f}% vs best"
                if p.get("slower_than_eager"):
                    verdict += "; slower than eager beyond the spread"
                rows.append([c["case"], str(b["batch"]), name, "+".join(short(d) for d in p["decisions"]),
                             f"{s['speedup']:.2f}x", short(b["oracle_best"]), verdict])  # fmt: skip
    out += ["", "### Strategies: the tuned result against the oracle", "",
            table(["case", "batch", "strategy", "picked", "speedup", "oracle best", "picked the best?"], rows),
            "", "LatencyBudget's budget is 1.25x eager's latency at the largest batch size. A miss is the tuned "
            "latency over the fastest backend's, as measured here; \"within the spread\" means the tuned model's "
            "interquartile range reaches the fastest contender's."]  # fmt: skip
    out += ["", "Rows met (the pick is the fastest contender, or within its spread):"]
    out += [f"- {name}: {n} of {total}" + (f"; slower than eager beyond the spread in {slow}" if slow else "")
            for name, (n, total, slow) in met.items()]  # fmt: skip

    rows = []
    for c in r["cases"]:
        for name, t in (c.get("tune_time") or {}).items():
            if "error" in t:
                rows.append([c["case"], name, "error", "", t["error"]])
                continue
            cold, warm = t["cold"], t["warm"]
            rows.append([c["case"], name, f"{cold['wall_s']:.1f}", f"{warm['wall_s']:.1f}",
                         f"{warm['from_cache']} of the builds from cache; picked {'+'.join(map(short, warm['decisions']))}"
                         + (f"; error: {cold['error']}" if cold["error"] else "")])  # fmt: skip
    if rows:
        out += ["", "### Tune wall time (fresh process; cold: empty cache; warm: the same tune again)", "",
                table(["case", "strategy", "cold s", "warm s", "notes"], rows)]  # fmt: skip

    rows = []
    for c in r["cases"]:
        for name, cs in (c.get("cold_start") or {}).items():
            if "error" in cs:
                rows.append([c["case"], name, "error", cs["error"] or ""])
                continue
            w = cs["wall_s"]
            p = cs["last_phases"] or {}
            rows.append([c["case"], name, f"{w['median']:.2f} ({w['min']:.2f}–{w['max']:.2f})",
                         f"import {p.get('import_s', 0):.2f}, ready {p.get('ready_s', 0):.2f}, "
                         f"first call {p.get('first_call_s', 0):.2f}"])  # fmt: skip
    if rows:
        out += ["", "### Cold start: fresh process to first output, s (median, min–max)", "",
                table(["case", "contender", "process s", "inside the child (last run)"], rows)]  # fmt: skip

    rows = []
    for name, o in r.get("overhead", {}).items():
        if "error" in o:
            rows.append([short(name), "error", "", "", o["error"]])
            continue
        u = o["us"]
        rows.append([short(name), f"{u['eager']:.1f}", f"{u['direct']:.1f}", f"{u['ait.Module']:.1f}",
                     f"{o['overhead_us']:.1f}"])  # fmt: skip
    if rows:
        out += ["", "### Per-call overhead of a tuned ait.Module (Linear(16, 16), batch 1, µs per call)", "",
                table(["backend", "eager", "backend.infer", "ait.Module", "overhead"], rows)]  # fmt: skip

    rows = []
    for c in r["cases"]:
        for n, f in c["oracle"].items():
            if not f["ok"]:
                continue
            for mod, a in f["modules"].items():
                rows.append([c["case"] if mod == c["case"] else f"{c['case']}/{mod}", short(n),
                             f"{a['max_rel_error']:.1e}" if a["max_rel_error"] is not None else "",
                             f"{a['cosine']:.6f}" if a["cosine"] is not None else "",
                             f"{f['build_s']:.1f}"])  # fmt: skip
    out += ["", "### Accuracy against eager (tuning report's validation) and build time", "",
            table(["case", "backend", "max rel err", "cosine", "build s"], rows),
            "", "Build s is the oracle's build in the main process, summed over a case's modules: a later "
            "build of an already compiled model class reuses Dynamo's work, so cold figures are in the "
            "tune wall time table."]  # fmt: skip
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # python -m benchmarks.report results.json: the tables again, from the JSON
    import json
    import sys
    from pathlib import Path

    print(markdown(json.loads(Path(sys.argv[1]).read_text())), end="")
