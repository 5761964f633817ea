"""Progress of a tune: rich progress lines in a terminal, plain log lines elsewhere.

Every step (recording, each candidate's build, validation, profiling) is also logged through the
``aitune`` logger, so piping to a file or running under CI still tells what happened and how long
it took.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger("aitune")


class TuneProgress:
    """Shows the running steps; ``enabled=None`` means: only when stderr is a terminal."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._live: Any = None

    def __enter__(self) -> TuneProgress:
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

    @contextlib.contextmanager
    def step(self, description: str) -> Iterator[None]:
        start = time.perf_counter()
        task = self._live.add_task(description, total=1) if self._live is not None else None
        logger.debug("%s ...", description)
        ok = False
        try:
            yield
            ok = True
        finally:
            elapsed = time.perf_counter() - start
            if task is not None:
                mark = "[green]✓[/]" if ok else "[red]✗[/]"
                self._live.update(task, description=f"{mark} {description}", completed=1)
            logger.info("%s %s in %.2f s", description, "done" if ok else "failed", elapsed)
