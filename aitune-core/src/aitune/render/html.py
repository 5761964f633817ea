"""The report as one self-contained HTML file: tables, inline SVG plots, no network.

Plots use matplotlib (the ``aitune-core[report]`` extra), rendered to SVG and inlined.
"""

from __future__ import annotations

import html
import io
from typing import Any

from ..errors import AituneError
from ..report import GraphReport, TuneReport, measured_at
from .tables import CANDIDATE_COLUMNS, candidate_rows, graph_inputs, graph_notes, headline, module_status

STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1200px;color:#1d2330;padding:0 1rem}
h1{font-size:1.6rem;margin-bottom:.2rem}h2{margin-top:2.2rem;border-bottom:2px solid #e3e7ef;padding-bottom:.3rem}
h3{font-size:1rem;color:#445}table{border-collapse:collapse;width:100%;font-size:.85rem;margin:.6rem 0}
th,td{border-bottom:1px solid #e3e7ef;padding:.35rem .5rem;text-align:left;vertical-align:top}
th{background:#f5f7fb}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.selected td{background:#eaf7ee;font-weight:600}tr.failed td{color:#8a1f1f}tr.baseline td{color:#555;font-style:italic}tr.not-applicable td,tr.skipped td,tr.superseded td{color:#777}
.summary{background:#f5f7fb;border-left:4px solid #3b6fd8;padding:.6rem .9rem;margin:.8rem 0;font-family:ui-monospace,monospace;font-size:.9rem}
.why{color:#445}.plots{display:flex;flex-wrap:wrap;gap:1rem}.plots svg{max-width:560px;height:auto}
dl{display:grid;grid-template-columns:max-content auto;gap:.2rem 1rem;font-size:.9rem}dt{color:#667}dd{margin:0}
.error{color:#8a1f1f}
"""


def _svg(fig: Any) -> str:
    out = io.StringIO()
    fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    text = out.getvalue()
    return text[text.index("<svg") :]


def _plots(graph: GraphReport) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise AituneError("the HTML report draws plots with matplotlib: pip install 'aitune-core[report]'") from exc
    series = {
        c.backend + ("" if c.status != "selected" else " (selected)"): c.profiles
        for c in graph.candidates
        if c.profiles
    }
    if graph.eager_profiles:
        series["torch_eager (baseline)"] = graph.eager_profiles
    if not series:
        return []
    plots = []
    batch = graph.selected_batch_size
    fig, ax = plt.subplots(figsize=(6, 0.5 + 0.45 * len(series)))
    names = list(series)
    for i, name in enumerate(names):
        profs = series[name]
        p = next((q for q in profs if q.batch_size == batch), None) or profs[-1]
        ax.plot([p.min_ms, p.p99_ms], [i, i], color="#9aa7c2", linewidth=1)
        ax.plot([p.p50_ms, p.p90_ms], [i, i], color="#3b6fd8", linewidth=6, solid_capstyle="butt")
        ax.plot([p.p50_ms], [i], "o", color="#1d2330", markersize=4)
    ax.set_yticks(range(len(names)), names)
    at = measured_at(graph.graph, batch) if batch else "the recorded inputs"
    ax.set_xlabel(f"latency (ms, log scale) at {at}: min-p99 line, p50-p90 bar, p50 dot")
    ax.set_xscale("log")
    ax.grid(axis="x", which="both", alpha=0.3)
    plots.append(_svg(fig))
    if any(len(p) > 1 for p in series.values()):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for name, profs in series.items():
            ordered = sorted(profs, key=lambda q: q.batch_size)
            ax.plot([q.batch_size for q in ordered], [q.throughput for q in ordered], marker="o", label=name)
        ax.set_xlabel("batch size")
        ax.set_ylabel("samples / s")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        plots.append(_svg(fig))
    frontier = _frontier(graph, plt)
    return plots + ([frontier] if frontier else [])


def _frontier(graph: GraphReport, plt: Any) -> str | None:
    """Speed-up against the user's metric for every candidate measured on both, the chosen one marked
    and the accuracy floor drawn: the trade-off the decision was made on."""
    points = [c for c in graph.candidates if c.metric is not None and c.speedup is not None]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for c in points:
        chosen = c.status == "selected"
        ax.plot([c.speedup], [c.metric], "*" if chosen else "o", markersize=12 if chosen else 6,
                color="#2a8a3e" if chosen else "#3b6fd8", gid=f"point-{'selected' if chosen else 'candidate'}")  # fmt: skip
        ax.annotate(c.label, (c.speedup, c.metric), fontsize=7, xytext=(4, 4), textcoords="offset points")
    if graph.accuracy_floor is not None:
        ax.axhline(graph.accuracy_floor, color="#8a1f1f", linestyle="--", linewidth=1, gid="accuracy-floor")
        ax.annotate(f"floor {graph.accuracy_floor:.4g} (1 - accuracy_budget)", (0.01, graph.accuracy_floor),
                    xycoords=("axes fraction", "data"), fontsize=7, color="#8a1f1f", xytext=(0, 3),
                    textcoords="offset points")  # fmt: skip
    ax.set_xlabel("speed-up over eager (the figure the decision used)")
    ax.set_ylabel("your metric (1.0: eager's answers)")
    ax.grid(alpha=0.3)
    ax.set_title("speed-accuracy frontier", fontsize=9)
    return _svg(fig)


NUMERIC = frozenset(
    {"build s", "validate s", "profile s", "max rel err", "cosine", "p50 ms", "p99 ms", "samples/s", "speedup"}
)
"""Columns right-aligned as numbers (a constant, not rebuilt for every table)."""


def _table(columns: tuple[str, ...] | list[str], rows: list[list[str]], classes: list[str] | None = None) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes else ""
        cells = "".join(
            f'<td class="num">{html.escape(v)}</td>' if c in NUMERIC else f"<td>{html.escape(v)}</td>"
            for c, v in zip(columns, row)
        )
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def render_html(report: TuneReport) -> str:
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<title>aitune tuning report</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>aitune tuning report</h1>",
        "<dl>" + "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in headline(report)) + "</dl>",
    ]
    for module in report.modules:
        parts.append(f"<h2>{html.escape(module.name)}</h2>")
        parts.append(f"<div class='summary'>{html.escape(module_status(module))}</div>")
        if module.error:
            parts.append(f"<p class='error'>{html.escape(module.error)}</p>")
        for i, graph in enumerate(module.graphs):
            parts.append(f"<h3>graph {i}: {html.escape(graph_inputs(graph))}</h3>")
            decision = f"Decision: <b>{html.escape(graph.decision or 'not made: the run stopped first')}</b>"
            if graph.selected_batch_size:
                decision += f" at {html.escape(measured_at(graph.graph, graph.selected_batch_size))}"
            parts.append(f"<p>{decision}</p>")
            if graph.reason:
                parts.append(f"<p class='why'>Why: {html.escape(graph.reason)}</p>")
            rows = candidate_rows(graph)
            classes = [
                r[1].split(" (")[0].replace(" ", "-") for r in rows
            ]  # "not applicable (build)" -> not-applicable
            parts.append(_table(CANDIDATE_COLUMNS, rows, classes))
            notes = graph_notes(graph)
            if notes:
                parts.append("<ul class='why'>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
            parts.append("<div class='plots'>" + "".join(_plots(graph)) + "</div>")
    env_rows = [[k, str(v)] for k, v in sorted(report.environment.items())]
    parts.append("<h2>Environment</h2>" + _table(["key", "value"], env_rows))
    parts.append("</body></html>")
    return "\n".join(parts)
