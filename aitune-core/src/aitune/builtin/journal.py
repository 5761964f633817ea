"""The tuning journal: progress written as it happens, so an interrupted ``ait.tune`` loses nothing.

A built-in observer plugin. When ``ait.tune`` is given a ``report_path``, every candidate (as
soon as it is complete: failed, or profiled) and every finished module is appended as one JSON line to ``<report>.journal.jsonl`` beside it, and
flushed at once. If the run is stopped (Ctrl-C, a killed process, a crash), :func:`partial_report`
rebuilds what was finished; the builds themselves are already in the build cache, so running the
same ``ait.tune`` again reuses them (their candidates show ``from_cache``).

Lines: ``{"event": "started", ...}``, ``{"event": "candidate", "module", "graph_key", "graph", "candidate"}``,
``{"event": "module", "module"}``, ``{"event": "finished", "duration_s"}``, or, when ``ait.tune``
raised, ``{"event": "failed", "error"}``; either way the file is closed. A new run with the same
report path starts the file afresh.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Generator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from .. import hookimpl
from ..converter import structure, unstructure
from ..errors import InputError
from ..files import make_folders
from ..session import Session

if TYPE_CHECKING:  # the tuner's report: a load registers this plugin and never imports it
    from ..report import CandidateReport, TuneReport

logger = logging.getLogger("aitune")
SUFFIX = ".journal.jsonl"


def journal_path(report_path: str | Path) -> Path:
    """``report.json`` -> ``report.journal.jsonl``, in the same folder."""
    path = Path(report_path)
    return path.with_name(path.stem + SUFFIX) if path.suffix else path.with_name(path.name + SUFFIX)


class Journal:
    """One run's open journal file."""

    def __init__(self, path: Path, report: TuneReport) -> None:
        self.path = path
        self.report = report
        self.modules_written = 0
        make_folders(path.parent, "report")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        self.file: IO[str] = open(fd, "w", encoding="utf-8")  # noqa: SIM115 - closed at tune_finished or tune_failed
        self.write(
            {
                "event": "started",
                "aitune_version": report.aitune_version,
                "device": report.device,
                "started_at": report.started_at,
                "environment": report.environment,
            }
        )

    def write(self, line: dict[str, Any]) -> None:
        self.file.write(json.dumps(line, default=str) + "\n")
        self.file.flush()  # in the kernel now: a killed process keeps it

    def catch_up(self) -> None:
        """Write the modules the report gained since the last line."""
        for module in self.report.modules[self.modules_written :]:
            self.write({"event": "module", "module": unstructure(module)})
        self.modules_written = len(self.report.modules)

    def close(self) -> None:
        self.file.close()


KEY = "aitune.journal"
"""Where the run's open journal sits in ``session.stash``."""


@hookimpl
def aitune_tune_started(report: TuneReport, report_path: Path | None, session: Session) -> None:
    if report_path is None:
        return
    try:
        session.stash[KEY] = Journal(journal_path(report_path), report)
    except OSError as exc:  # progress keeping must never stop tuning
        logger.warning("no tuning journal beside %s: %s", report_path, exc)


@hookimpl
def aitune_candidate_result(module_name: str, graph: Any, candidate: CandidateReport, session: Session) -> None:
    journal = session.stash.get(KEY)
    if journal is None:
        return
    journal.catch_up()
    journal.write(
        {
            "event": "candidate",
            "module": module_name,
            "graph_key": graph.key,
            "graph": unstructure(graph),
            "candidate": unstructure(candidate),
        }
    )


@hookimpl(wrapper=True, tryfirst=True)
def aitune_build(backend: Any, module: Any, context: Any, session: Session) -> Generator[None, Any, Any]:
    """Before each build, write the modules finished since the last line (a build may never return)."""
    journal = session.stash.get(KEY)
    if journal is not None:
        journal.catch_up()
    return (yield)


def _end(session: Session, last: dict[str, Any]) -> None:
    journal = session.stash.pop(KEY, None)
    if journal is None:
        return
    try:
        journal.catch_up()
        journal.write(last)
    finally:
        journal.close()


@hookimpl
def aitune_tune_finished(report: TuneReport, session: Session) -> None:
    _end(session, {"event": "finished", "duration_s": report.duration_s})


@hookimpl
def aitune_tune_failed(report: TuneReport, error: BaseException, session: Session) -> None:
    """Close the journal; a cut-off module's candidates stay in it and read back as ``interrupted``."""
    _end(session, {"event": "failed", "error": f"{type(error).__name__}: {error}"})


def partial_report(path: str | Path) -> TuneReport:
    """What a journal (or the report path it sits beside) says was finished, as a report.

    Finished modules come back as they were; candidates of a module that was cut off come back
    under a module with status ``interrupted``. A torn last line (the process died mid-write)
    is ignored.
    """
    from ..report import CandidateReport, GraphReport, ModuleReport, ModuleStatus, TuneReport

    path = Path(path)
    if not path.name.endswith(SUFFIX):
        path = journal_path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InputError(f"no tuning journal at {path} ({exc}); pass the report path given to ait.tune") from exc
    report = TuneReport()
    done: set[str] = set()
    open_modules: dict[str, ModuleReport] = {}
    finished = False
    for number, text in enumerate(lines, 1):
        try:
            line = json.loads(text)
        except ValueError:
            if number == len(lines):
                break
            raise InputError(f"{path} line {number} is not JSON; the journal is damaged") from None
        event = line.get("event")
        if event == "started":
            report.aitune_version = line.get("aitune_version", "")
            report.device = line.get("device", "")
            report.started_at = line.get("started_at", "")
            report.environment = line.get("environment", {})
        elif event == "candidate":
            name = line["module"]
            module = open_modules.setdefault(
                name, ModuleReport(name=name, strategy="", status=ModuleStatus.INTERRUPTED)
            )
            graph = next((g for g in module.graphs if g.graph_key == line["graph_key"]), None)
            if graph is None:
                graph = GraphReport(graph_key=line["graph_key"], graph=line.get("graph") or {})
                module.graphs.append(graph)
            graph.candidates.append(structure(line["candidate"], CandidateReport, "candidate"))
        elif event == "module":
            module = structure(line["module"], ModuleReport, "module")
            open_modules.pop(module.name, None)
            report.modules.append(module)
            done.add(module.name)
        elif event == "finished":
            report.duration_s = float(line.get("duration_s", 0.0))
            finished = True
    if not finished:
        report.modules.extend(m for name, m in open_modules.items() if name not in done)
    return report
