"""Traced branches judged instead of refused: where a TorchScript trace froze a Python value, and
whether the trace still answers as eager on inputs made to take the other side.

The TorchScript tracer records tensor operations only. Where the module turns a tensor into a
Python value (``if mask.all():``, ``int(x.sum())``, a size compared in Python), the trace keeps
the value its sample gave, and warns (a ``TracerWarning`` at that line). Such a site is one of:

- a *value* branch: eager converts a real tensor there too, so running eager with the
  conversions recorded (:func:`conversions`) says which value each input gives. It is judged
  only where some input made for the purpose (the recorded calls, an all-ones and a padded
  mask, the other lengths) takes the other side, and the trace answers as eager on it;
- a *shape* branch: in eager the sizes are Python ints and nothing is converted; the value
  depends on sizes only, so the trace is run at the other lengths (each dynamic dim's min and
  max, the recorded calls' sizes) and must answer as eager there.

A value branch no made input flips (``if y.sum() < -1000`` on data that is never negative) stays
refused: nothing shows the other side is right. The trace is taken from a sample on the general
side where the inputs allow: a padded attention mask, so a model's "mask all ones?" shortcut
freezes to the path that is right for every mask.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch

from .graph import GraphSpec, Sample, resize
from .text import clip

TRACE_BRANCHES = "might cause the trace to be incorrect"
"""What the TorchScript tracer says when a tensor became a Python bool, number or index: the
trace froze the branch or the size this one sample gave."""

_CONVERSIONS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist")
"""The tensor methods that hand a Python value to the code (what the tracer warns about)."""

Site = tuple[str, int]
"""Where a tensor became a Python value: file name and line."""


@attrs.frozen
class Branch:
    """One place where the trace froze a Python value, as the tracer named it."""

    site: Site
    message: str


def branches(caught: Sequence[warnings.WarningMessage]) -> list[Branch]:
    """The distinct sites of the tracer's warnings that it froze a value, in the order met."""
    found: dict[Site, Branch] = {}
    for w in caught:
        text = str(w.message)
        if TRACE_BRANCHES in text and (w.filename, w.lineno) not in found:
            found[(w.filename, w.lineno)] = Branch((w.filename, w.lineno), clip(text.splitlines()[0], 200))
    return list(found.values())


_LOCK = threading.Lock()


@contextlib.contextmanager
def conversions() -> Iterator[dict[Site, set[Any]]]:
    """Record, per calling line, the values tensors turned into while the block runs (this thread).

    The tensor conversion methods are wrapped for the block's duration (other threads call through
    unrecorded); a value that is not hashable is recorded by its repr.
    """
    seen: dict[Site, set[Any]] = {}
    me = threading.get_ident()
    originals = {name: torch.Tensor.__dict__.get(name) for name in _CONVERSIONS}

    def wrap(name: str) -> Callable[..., Any]:
        method = getattr(torch.Tensor, name)

        def recorded(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            value = method(self, *args, **kwargs)
            if threading.get_ident() == me:
                frame = sys._getframe(1)
                try:
                    hash(value)
                except TypeError:
                    value = repr(value)
                seen.setdefault((frame.f_code.co_filename, frame.f_lineno), set()).add(value)
            return value

        return recorded

    with _LOCK:
        for name in _CONVERSIONS:
            setattr(torch.Tensor, name, wrap(name))
        try:
            yield seen
        finally:
            for name, original in originals.items():
                if original is None:
                    delattr(torch.Tensor, name)
                else:
                    setattr(torch.Tensor, name, original)


def is_mask(path: str, spec_dtype: str) -> bool:
    """An attention-style mask: an integer or bool input named ``...mask``."""
    name = path.rsplit(".", 1)[-1].lower()
    return "mask" in name and not spec_dtype.startswith(("float", "bfloat", "complex"))


def general_sample(graph: GraphSpec, samples: Sequence[Sample], sizes: dict[str, int]) -> Sample:
    """The sample to trace from, at ``sizes``: a recorded one with a padded mask where there is
    one, else the first with the last position of its first row masked (the general side of a
    "mask all ones?" shortcut). Without a mask input: the first sample, resized."""
    masks = [i for i, spec in enumerate(graph.inputs) if is_mask(spec.path, spec.dtype)]
    padded = [s for s in samples if any(_has_zero(graph.flatten(s.args, s.kwargs)[i]) for i in masks)]
    chosen = resize(graph, (padded or list(samples))[0], sizes)
    if not masks:
        return chosen
    tensors = [t.clone() for t in graph.flatten(chosen.args, chosen.kwargs)]
    if not any(_has_zero(tensors[i]) for i in masks):
        for i in masks:
            if tensors[i].dim() == 2 and tensors[i].shape[1] > 1:
                tensors[i][0, -1] = 0
    args, kwargs = graph.unflatten(tensors)
    return Sample(args, kwargs)


def _has_zero(t: torch.Tensor) -> bool:
    return t.numel() > 0 and bool((t == 0).any())


def probes(graph: GraphSpec, traced_from: Sample, samples: Sequence[Sample]) -> list[tuple[str, Sample]]:
    """Inputs made to take the other side of the trace's branches, each with what it is: the
    recorded calls, the trace's sample with every mask all ones, and at each dynamic dim's
    smallest and largest size."""
    made: list[tuple[str, Sample]] = [(f"recorded call {i}", s) for i, s in enumerate(samples)]
    tensors = graph.flatten(traced_from.args, traced_from.kwargs)
    masks = [i for i, spec in enumerate(graph.inputs) if is_mask(spec.path, spec.dtype)]
    if masks:
        ones = [torch.ones_like(t) if i in masks else t for i, t in enumerate(tensors)]
        args, kwargs = graph.unflatten(ones)
        made.append(("every mask all ones", Sample(args, kwargs)))
    for which in ("min", "max"):
        sizes = {name: getattr(rng, which) for name, rng in graph.dims.items()}
        if sizes:
            made.append((f"every dynamic dim at its {which} ({sizes})", resize(graph, traced_from, sizes)))
    return made


def judge(
    traced: Callable[..., Any],
    eager: Callable[..., Any],
    graph: GraphSpec,
    found: Sequence[Branch],
    traced_from: Sample,
    samples: Sequence[Sample],
) -> tuple[str | None, list[dict[str, Any]]]:
    """Why the trace may not be kept (None: it may), and per branch what the inputs gave.

    ``traced`` and ``eager`` take the graph's flat input tensors and return flat output tensors.
    """
    sites = {b.site for b in found}
    with torch.no_grad(), conversions() as at_trace:
        eager(*graph.flatten(traced_from.args, traced_from.kwargs))
    frozen = {site: at_trace[site] for site in sites if site in at_trace}  # value branches; the rest shapes
    flipped: dict[Site, str] = {}
    made = probes(graph, traced_from, samples)
    for what, sample in made:
        flat = graph.flatten(sample.args, sample.kwargs)
        with torch.no_grad():
            try:
                with conversions() as seen:
                    expected = eager(*flat)
            except Exception:  # an input the model itself refuses shows nothing about the trace
                continue
            try:
                actual = traced(*flat)
            except Exception as exc:
                return f"the trace fails on {what} ({type(exc).__name__}: {clip(str(exc), 200)})", []
        other = [site for site in frozen if site in seen and seen[site] != frozen[site]]
        differs = _difference(actual, expected)
        if differs is not None:
            sides = ", ".join(f"{_where(s)} gave {sorted(seen[s], key=repr)}" for s in other)
            because = f" ({sides}; the trace holds {', '.join(_where(s) for s in other)} fixed)" if other else ""
            return f"on {what} the trace differs from eager: {differs}{because}", []
        for site in other:
            flipped.setdefault(site, what)
    lengths = "; ".join(what for what, _ in made)
    summary = [
        {
            "site": _where(b.site),
            "kind": "value" if b.site in frozen else "shape",
            "traced": sorted(map(repr, frozen[b.site])) if b.site in frozen else None,
            "other_side": flipped.get(b.site) if b.site in frozen else lengths,
            "other_side_checked": b.site in flipped or b.site not in frozen,
        }
        for b in found
    ]
    unjudged = [site for site in frozen if site not in flipped]
    if unjudged:
        return (
            f"no input aitune could make takes the other side of the value branch at {_where(unjudged[0])} "
            f"(every one gave {sorted(frozen[unjudged[0]], key=repr)}), so nothing shows the trace is right there",
            summary,
        )
    return None, summary


def _where(site: Site) -> str:
    return f"{site[0].rsplit('/', 1)[-1]}:{site[1]}"


def _difference(actual: Any, expected: Any) -> str | None:
    """How the trace's outputs differ from eager's beyond float32 rounding, or None."""
    a, e = list(actual), list(expected)
    if len(a) != len(e):
        return f"{len(a)} outputs instead of {len(e)}"
    for i, (x, y) in enumerate(zip(a, e)):
        if x.shape != y.shape:
            return f"output {i} has shape {tuple(x.shape)} instead of {tuple(y.shape)}"
        if not y.dtype.is_floating_point:
            if not torch.equal(x, y):
                return f"output {i} holds other values"
            continue
        scale = float(y.abs().max()) if y.numel() else 0.0
        err = float((x.double() - y.double()).abs().max()) if y.numel() else 0.0
        if err > 1e-4 * scale + 1e-5:
            return f"output {i} is off by {err:.3g} (scale {scale:.3g})"
    return None
