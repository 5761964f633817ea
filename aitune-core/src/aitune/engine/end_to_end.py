"""The end-to-end figure: the callable ``ait.tune`` was given, eager against tuned, over its dataset.

Each round times one pass over the kept dataset items eager (every wrapper calling through, as
while aitune builds) and one tuned, back to back, in alternating order; the figure is the ratio of
the median passes and its interval the quartiles of the per-round ratios, the statistic each
module's figure uses. Rounds go on until that interval is within ``max_noise`` or the time budget
is spent; then the figure is shown by the bound it clears, or "not measured" when it straddles 1.
One more eager pass, with a timer around each wrapped module, gives each module's share of the
time: the most tuning it can save.

Where aitune changed the user's objects to tune them (``generate()`` switched to a static cache),
each round also times eager as the user set it up (:class:`UsersSetup`): the figure is against
that, what the user would run without aitune, and the one against the changed eager is reported
next to it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ..profiling import spread
from ..report import MAX_NOISE, BaselineFigure, EndToEndReport, noise_of
from . import recording

MIN_ROUNDS = 4
MAX_ROUNDS = 30
MIN_HALF_WIDTH = 0.02
"""The interval is never narrower than ±2%: a process measuring the same model again afterwards
differs by about that much (CPU clocks, caches) even when every round agrees."""


@attrs.frozen
class UsersSetup:
    """How to run eager as the user set it up, before aitune changed something to tune it."""

    undone: Callable[[], contextlib.AbstractContextManager[Any]]
    """A context inside which the change is undone (and after which it is back)."""
    label: str
    """The eager passes run inside it, as the report names them: ``eager with the default cache``."""
    changed_label: str
    """The eager passes run with the change: ``eager with the static cache``."""


def measure(
    call: Callable[[Any], Any],
    items: Sequence[Any],
    modules: Sequence[Any],
    budget_s: float,
    max_noise: float = MAX_NOISE,
    users: UsersSetup | None = None,
) -> EndToEndReport:
    """Time ``call`` over ``items`` eager and tuned; ``modules`` are the wrappers to share the time among.

    With ``users``, eager also runs as the user set it up, in the same rounds: the figure is against
    that, and the one against eager as changed is in ``other_baselines``.
    """
    if not items:
        return EndToEndReport(reason="no dataset items were kept")
    kinds = ["eager", "tuned", *(["users"] if users is not None else [])]
    passes: dict[str, list[float]] = {kind: [] for kind in kinds}
    base = "users" if users is not None else "eager"

    def timed(kind: str) -> float:
        if kind == "users" and users is not None:
            with users.undone():
                return _pass(call, items, eager=True)
        return _pass(call, items, eager=kind != "tuned")

    try:
        with torch.no_grad(), warnings.catch_warnings(record=True) as seen, contextlib.ExitStack() as kept:
            warnings.simplefilter("always")
            for module in modules:  # the user's own first calls still get each warning once
                kept.enter_context(module.warnings_kept())
            for kind in kinds:  # warm-up: lazy inits, caches
                timed(kind)
            deadline = time.perf_counter() + budget_s
            while len(passes["tuned"]) < MAX_ROUNDS:
                shift = len(passes["tuned"]) % len(kinds)  # each kind goes first in turn
                for kind in kinds[shift:] + kinds[:shift]:
                    passes[kind].append(timed(kind))
                if len(passes["tuned"]) >= MIN_ROUNDS and (
                    _converged(passes[base], passes["tuned"], max_noise) or time.perf_counter() > deadline
                ):
                    break
            shares = _shares(call, items, modules)
    except Exception as exc:  # the figure is a report, never a reason to fail the tune
        return EndToEndReport(reason=f"timing the whole call raised {type(exc).__name__}: {exc}")
    eager_calls = sorted({str(w.message) for w in seen if "running this call eager" in str(w.message)})
    speedup, low, high = _figure(passes[base], passes["tuned"])
    others = []
    if users is not None:
        s, lo, hi = _figure(passes["eager"], passes["tuned"])
        changed = statistics.median(passes["eager"]) * 1e3
        others.append(BaselineFigure(users.changed_label, s, lo, hi, noise_of(s, lo, hi) <= max_noise, changed))
    return EndToEndReport(
        speedup=speedup,
        speedup_low=low,
        speedup_high=high,
        measured=noise_of(speedup, low, high) <= max_noise,
        eager_ms=statistics.median(passes[base]) * 1e3,
        tuned_ms=statistics.median(passes["tuned"]) * 1e3,
        rounds=len(passes["tuned"]),
        items=len(items),
        shares=shares,
        reason=f"some tuned calls ran eager while timed: {eager_calls[0]}" if eager_calls else None,
        baseline=users.label if users is not None else "eager",
        other_baselines=others,
    )


def _pass(call: Callable[[Any], Any], items: Sequence[Any], eager: bool) -> float:
    start = time.perf_counter()
    if eager:
        with recording.bypass():
            for item in items:
                call(item)
    else:
        for item in items:
            call(item)
    return time.perf_counter() - start


def _figure(eager: Sequence[float], tuned: Sequence[float]) -> tuple[float, float, float]:
    speedup = statistics.median(eager) / statistics.median(tuned)
    low, high = spread([e / t for e, t in zip(eager, tuned) if t > 0])
    floor = speedup * MIN_HALF_WIDTH
    return speedup, min(low, speedup - floor), max(high, speedup + floor)


def _converged(eager: Sequence[float], tuned: Sequence[float], max_noise: float) -> bool:
    speedup, low, high = _figure(eager, tuned)
    return noise_of(speedup, low, high) <= max_noise


def _shares(call: Callable[[Any], Any], items: Sequence[Any], modules: Sequence[Any]) -> dict[str, float]:
    """One eager pass with a timer around each wrapped module's own module."""
    spent: dict[str, float] = {m.name: 0.0 for m in modules}
    started: dict[str, list[float]] = {m.name: [] for m in modules}
    handles = []
    for m in modules:
        handles.append(m.module.register_forward_pre_hook(lambda *_, n=m.name: started[n].append(time.perf_counter())))
        handles.append(m.module.register_forward_hook(lambda *_, n=m.name: _stop(spent, started, n)))
    try:
        total = _pass(call, items, eager=True)
    finally:
        for handle in handles:
            handle.remove()
    return {name: min(1.0, t / total) for name, t in spent.items()} if total > 0 else {}


def _stop(spent: dict[str, float], started: dict[str, list[float]], name: str) -> None:
    if started[name]:
        spent[name] += time.perf_counter() - started[name].pop()
