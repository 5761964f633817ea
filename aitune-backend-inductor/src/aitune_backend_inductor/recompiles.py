"""Noticing a compiled module that keeps compiling again at run time, before TorchDynamo gives up.

A guard that fails on every call (a Python int the module reads that changes each step, an
attribute the user keeps setting) makes Dynamo compile again each time, until its recompile limit
(``torch._dynamo.config.recompile_limit``, 8) after which it silently runs that forward uncompiled
for the rest of the process. The watch counts the compiles a call triggers; past its limit it warns
once, naming the guard that failed, and from then on refuses a call that would compile again
(:class:`RecompileRefused`), so aitune's dispatcher runs that call eager and every call the
compiled code covers stays compiled.

Before a build, :func:`predicted_recompiles` foresees the worst case of it, the module's own code
fixing a dimension the recorded calls vary, so that candidate is skipped instead of built.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aitune.plugin import GraphSpec, Sample, resize

from .shapes import dim_sizes, unwarmed_sizes

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


def predicted_recompiles(
    run: Callable[[Sample], int],
    graph: GraphSpec,
    cases: Sequence[tuple[str, Sample]],
    limit: int = RUNTIME_RECOMPILES,
) -> str | None:
    """Why the compiled module would compile again more than ``limit`` times at run time, or None.

    ``run`` calls a stand-in of the compiled module that traces with TorchDynamo as the build will
    (same ``dynamic``, same marked axes) but compiles nothing, and returns how many graphs the call
    traced: its guards are the build's, at a fraction of the cost. After the warm-up's ``cases``, each
    dynamic dimension alone moves to two sizes no warm-up used; when both trace again, the module's
    code fixes that dimension, and each of its unwarmed sizes would compile at run time.
    """
    for _, sample in cases:
        run(sample)
    seen = [dim_sizes(graph, s) for _, s in cases]
    base = cases[0][1]
    for name, rng in graph.dims.items():
        count, probes = unwarmed_sizes(rng, [s[name] for s in seen if name in s])
        if count <= limit or len(probes) < 2:
            continue
        before = _failure_counts()
        if not all(run(resize(graph, base, {name: size})) for size in probes):
            continue
        guards = _failures_since(before)
        guard = f"; the guard that failed: {_first_line(guards[-1])}" if guards else ""
        where = ", ".join(f"{spec.path!r} axis {axis}" for spec in graph.inputs for axis in _axes(spec.dims, name))
        return (
            f"the module's code fixes the dynamic dimension {name} ({where}, {rng.min}..{rng.max} in the recorded "
            f"calls): TorchDynamo traced again at {name}={probes[0]} and {name}={probes[1]}{guard}. Each of its "
            f"{count} sizes the warm-up does not cover would compile at run time, past the {limit} compiles "
            "torch_inductor_jit allows there, so this candidate is skipped before it is built. Make the code "
            "independent of that size (no Python loop or int() over it), tune with calls of one size, or pick "
            "an exporting backend such as torch_inductor_aot"
        )
    return None


def _axes(dims: Sequence[str | None], name: str) -> list[int]:
    return [axis for axis, d in enumerate(dims) if d == name]


def _failures_since(before: dict[Any, int]) -> list[str]:
    from torch._dynamo.utils import guard_failures

    return [str(r) for code, reasons in list(guard_failures.items()) for r in reasons[before.get(code, 0) :]]


def _failure_counts() -> dict[Any, int]:
    from torch._dynamo.utils import guard_failures

    return {code: len(reasons) for code, reasons in list(guard_failures.items())}


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), text)
