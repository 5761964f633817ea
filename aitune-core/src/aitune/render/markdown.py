"""The report as markdown, for CI logs and pull requests."""

from __future__ import annotations

from ..report import TuneReport, measured_at
from .tables import CANDIDATE_COLUMNS, candidate_rows, graph_inputs, graph_notes, headline, module_status


def _row(cells: list[str] | tuple[str, ...]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def render_markdown(report: TuneReport) -> str:
    lines = ["# aitune tuning report", ""]
    lines += [_row(("", "")), _row(("---", "---"))]
    lines += [_row((k, v)) for k, v in headline(report)]
    for module in report.modules:
        lines += ["", f"## {module.name}", "", module_status(module)]
        if module.error:
            lines += ["", f"Error: `{module.error}`"]
        for i, graph in enumerate(module.graphs):
            lines += ["", f"### graph {i}: {graph_inputs(graph)}", ""]
            lines += [
                f"Decision: **{graph.decision or 'not made: the run stopped first'}**"
                + (f" at {measured_at(graph.graph, graph.selected_batch_size)}" if graph.selected_batch_size else ""),
                "",
            ]
            if graph.reason:
                lines += [f"Why: {graph.reason}", ""]
            lines += [_row(CANDIDATE_COLUMNS), _row(["---"] * len(CANDIDATE_COLUMNS))]
            lines += [_row(r) for r in candidate_rows(graph)]
            notes = graph_notes(graph)
            if notes:
                lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
