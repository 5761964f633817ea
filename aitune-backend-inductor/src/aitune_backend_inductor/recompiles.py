"""Noticing a compiled module that keeps compiling again at run time, before TorchDynamo gives up.

A guard that fails on every call (a Python int the module reads that changes each step, an
attribute the user keeps setting) makes Dynamo compile again each time, until its recompile limit
(``torch._dynamo.config.recompile_limit``, 8) after which it silently runs that forward uncompiled
for the rest of the process. The watch counts the compiles a call triggers; past its limit it warns
once, naming the guard that failed, and from then on refuses a call that would compile again
(:class:`RecompileRefused`), so aitune's dispatcher runs that call eager and every call the
compiled code covers stays compiled.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

RUNTIME_RECOMPILES = 4
"""Compiles at run time tolerated before the watch warns and refuses more (a sliding-window cache
legitimately needs one or two: its counter becoming symbolic, then the window filling up)."""


class RecompileRefused(RuntimeError):
    """A call would make the compiled module compile again after the watch's limit."""


class RecompileWatch:
    """Wraps the calls of one compiled module (see the module docstring)."""

    def __init__(self, what: str, limit: int = RUNTIME_RECOMPILES) -> None:
        self.what = what
        self.limit = min(limit, max(1, torch._dynamo.config.recompile_limit // 2))
        self.recompiles = 0
        self.reasons: list[str] = []
        self.stopped = False
        self._seen = _failure_counts()

    def call(self, compiled: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.utils import counters

        if self.stopped:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    return compiled(*args, **kwargs)
            except RuntimeError as exc:
                if "recompile" not in str(exc):
                    raise
                raise RecompileRefused(
                    f"{self.what} would compile again ({self.recompiles} compiles at run time already); "
                    "this call runs eager"
                ) from None
        graphs = counters["stats"]["unique_graphs"]
        out = compiled(*args, **kwargs)
        if counters["stats"]["unique_graphs"] != graphs:
            self._compiled_again()
        return out

    def _compiled_again(self) -> None:
        self.recompiles += 1
        self.reasons += self._new_failures()
        if self.recompiles < self.limit:
            return
        self.stopped = True
        reason = _first_line(self.reasons[-1]) if self.reasons else "TorchDynamo gave no guard failure"
        warnings.warn(
            f"{self.what}: the compiled module compiled again {self.recompiles} times at run time; the guard that "
            f"failed last: {reason}. A value it specialises on changes from call to call, and at TorchDynamo's "
            f"recompile limit ({torch._dynamo.config.recompile_limit}) it would stop compiling this forward for "
            "the rest of the process: from now on a call that would compile again runs eager. Tune with calls "
            "that cover the values that change, or pass that value as a tensor",
            RuntimeWarning,
            stacklevel=2,
        )

    def _new_failures(self) -> list[str]:
        now = _failure_counts()
        from torch._dynamo.utils import guard_failures

        new = [r for code, reasons in list(guard_failures.items()) for r in reasons[self._seen.get(code, 0) :]]
        self._seen = now
        return [str(r) for r in new]


def _failure_counts() -> dict[Any, int]:
    from torch._dynamo.utils import guard_failures

    return {code: len(reasons) for code, reasons in list(guard_failures.items())}


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), text)
