"""Progress of a tune: what runs now, for how long, and how much of the time budget is left.

Every step (recording, each candidate's build, validation, profiling) logs its start and its end
through the ``aitune`` logger, and a step still running after :data:`HEARTBEAT_S` logs a line every
:data:`HEARTBEAT_S` seconds (a 5-minute compiler build is never silent), so piping to a file or
running under CI tells what happens as it happens. In a terminal the same steps show live as rich
progress lines with their elapsed time. The seconds each step took add up per stage and per
candidate (:meth:`TuneProgress.charge`): the report's "where the time went", by phase (export,
build, validate, profile, waiting...) and by candidate. ``time_budget`` bounds a tune: once it is
spent no further candidate is built.

Every duration is read from :data:`clock`, so tests script time instead of sleeping.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

logger = logging.getLogger("aitune")

HEARTBEAT_S = 30.0
"""A step still running after this many seconds logs a line, and again every as many seconds."""

clock: Callable[[], float] = time.perf_counter
"""Where every step's time is read (tests put a scripted clock here)."""


class Step:
    """One running step: its description, start and, once it ended, its duration in seconds."""

    def __init__(self, description: str, stage: str | None) -> None:
        self.description = description
        self.stage = stage
        self.started = clock()
        self.seconds: float | None = None

    def elapsed(self) -> float:
        return clock() - self.started if self.seconds is None else self.seconds


class Heartbeat:
    """Logs ``<step>: still running after N s`` every ``interval`` seconds until stopped.

    :meth:`run` is the loop a daemon thread runs; ``wait(seconds)`` returns True once the step has
    ended (``threading.Event.wait``), so a test drives the loop with a scripted ``wait`` and clock.
    """

    def __init__(self, step: Step, interval: float = HEARTBEAT_S, on_beat: Callable[[Step], None] | None = None):
        self.step = step
        self.interval = interval
        self.on_beat = on_beat

    def run(self, wait: Callable[[float], bool]) -> None:
        while not wait(self.interval):
            self.beat()

    def beat(self) -> None:
        logger.info("%s: still running after %.0f s", self.step.description, self.step.elapsed())
        if self.on_beat is not None:
            self.on_beat(self.step)


class TuneProgress:
    """Shows and logs the running steps and keeps the time they took per stage.

    ``enabled=None`` shows live progress lines only when stderr is a terminal (log lines are
    written either way). ``time_budget`` (seconds) is what :meth:`out_of_time` checks.
    """

    def __init__(
        self, enabled: bool | None = None, time_budget: float | None = None, heartbeat_s: float = HEARTBEAT_S
    ) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.time_budget = time_budget
        self.heartbeat_s = heartbeat_s
        self.started = clock()
        self.spent: dict[str, float] = collections.defaultdict(float)
        """Seconds per stage (``recording``, ``export``, ``build``, ``validate``, ``profile``, ``waiting``...)."""
        self.by_candidate: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
        """The same seconds by whom they were spent on (``module: backend (variant)``), then by stage:
        for every stage charged per candidate, the candidates' seconds add up to the stage's."""
        self._live: Any = None

    def __enter__(self) -> TuneProgress:
        self.started = clock()
        if self.enabled:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._live = Progress(
                SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=False
            )
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def elapsed(self) -> float:
        return clock() - self.started

    def out_of_time(self) -> bool:
        """Whether the time budget is spent (never without one)."""
        return self.time_budget is not None and self.elapsed() >= self.time_budget

    def budget_text(self) -> str:
        """Why a candidate was not built: the budget and what was spent of it."""
        return (
            f"time budget: {self.elapsed():.0f} s of {self.time_budget:g} s spent before its turn; raise "
            "ait.tune(time_budget=...) to try it"
        )

    def charge(self, who: str, stage: str, seconds: float) -> None:
        """Count ``seconds`` of ``stage`` as spent on ``who`` (a candidate, or what else the time went to)."""
        self.spent[stage] += seconds
        self.by_candidate[who][stage] += seconds

    @contextlib.contextmanager
    def step(self, description: str, stage: str | None = None, charge_to: Sequence[str] = ()) -> Iterator[Step]:
        """Run one step: logged at its start and end, a heartbeat while it runs, its seconds added to ``stage``.

        ``charge_to`` shares the seconds out equally among those it names (the contenders of one
        interleaved profiling round); with ``stage`` None the caller charges them itself
        (a build splits its seconds into export, waiting and build).
        """
        step = Step(description, stage)
        task = self._live.add_task(description, total=1) if self._live is not None else None
        logger.info("%s ...", description)
        stop = threading.Event()
        beat = Heartbeat(step, self.heartbeat_s)
        thread = threading.Thread(target=beat.run, args=(stop.wait,), name="aitune-heartbeat", daemon=True)
        thread.start()
        ok = False
        try:
            yield step
            ok = True
        finally:
            stop.set()
            step.seconds = clock() - step.started
            if stage is not None and charge_to:
                for who in charge_to:
                    self.charge(who, stage, step.seconds / len(charge_to))
            elif stage is not None:
                self.spent[stage] += step.seconds
            if task is not None:
                mark = "[green]✓[/]" if ok else "[red]✗[/]"
                self._live.update(task, description=f"{mark} {description}", completed=1)
            logger.info("%s %s in %.2f s", description, "done" if ok else "failed", step.seconds)
            thread.join()
