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

``torch.export`` (the dynamo exporter's capture) specialises the same way, but says so: a size the
code compares with a constant narrows that dim's range in the exported program (``if
x.shape[1] > 100`` traced at 16 holds the dim to ``<= 100``) or becomes a runtime assertion
(``Ne(d0, 100)``, ``Eq(Mod(d0, 2), 0)``) that the ONNX graph drops. :func:`shape_guards` reads
both and finds sizes of the tuned range on the other side; :func:`judge_guards` runs the exported
program there against eager. The TorchScript judge probes those sizes too, so a shape branch at a
size no recorded call, min or max had (``== 100`` inside 8..512) is judged on both exporters.
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
    sizes_past: Callable[[], Sequence[tuple[str, Sample]]] | None = None,
) -> tuple[str | None, list[dict[str, Any]]]:
    """Why the trace may not be kept (None: it may), and per branch what the inputs gave.

    ``traced`` and ``eager`` take the graph's flat input tensors and return flat output tensors.
    ``sizes_past`` gives inputs at the sizes where the code's size comparisons turn (from
    :func:`shape_guards`); asked only when a branch is a shape branch, since min and max alone miss
    a branch at one size inside the range.
    """
    sites = {b.site for b in found}
    with torch.no_grad(), conversions() as at_trace:
        eager(*graph.flatten(traced_from.args, traced_from.kwargs))
    frozen = {site: at_trace[site] for site in sites if site in at_trace}  # value branches; the rest shapes
    flipped: dict[Site, str] = {}
    made = probes(graph, traced_from, samples)
    if sizes_past is not None and len(frozen) < len(sites):
        made.extend(sizes_past())
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


# -- sizes an exported program holds fixed ---------------------------------------------------------


@attrs.frozen
class ShapeGuard:
    """A condition on input sizes that an exported program holds (its code took one side of a size
    comparison), and sizes of the tuned range on the other side, each a ``{dim: size}``."""

    condition: str
    other_side: tuple[dict[str, int], ...]


MAX_PROBES = 3
"""Sizes on the other side of one guard that are run: the ones nearest the traced size."""


def shape_guards(program: Any, graph: GraphSpec, sizes: dict[str, int]) -> list[ShapeGuard]:
    """The conditions on dynamic dims that ``program`` (a ``torch.export.ExportedProgram`` of
    :class:`~aitune.graph.FlatModule`, traced at ``sizes``) holds, each with sizes inside the graph's
    ranges that break it: a dim's range narrowed below the tuned one, and runtime assertions on sizes
    (data-dependent ones, on values the code read from tensors, are not sizes and are left out)."""
    import sympy  # type: ignore[import-untyped]  # torch depends on it; it ships no types

    names = _dim_symbols(program, graph)
    env = {sym: sympy.Integer(sizes[name]) for sym, name in names.items() if name in sizes}
    guards: list[ShapeGuard] = []
    for sym, name in names.items():
        rng, held = graph.dims[name], program.range_constraints.get(sym)
        if held is None:
            continue
        low, high = _finite(held.lower), _finite(held.upper)
        other = []
        if low is not None and low > rng.min:
            other += [low - 1, rng.min]
        if high is not None and high < rng.max:
            other += [high + 1, rng.max]
        if other:
            guards.append(ShapeGuard(f"{low} <= {name} <= {high}", tuple({name: v} for v in dict.fromkeys(other))))
    for node in program.graph.nodes:
        if node.target is not torch.ops.aten._assert_scalar.default or not node.args:
            continue
        value = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if not isinstance(value, torch.SymBool):
            continue
        expr = value.node.expr
        free = expr.free_symbols
        if not free or not free <= names.keys():
            continue
        broken = [
            {names[sym]: v} for sym in sorted(free, key=str) for v in _breaking(expr, sym, env, graph.dims[names[sym]])
        ]
        if broken:
            readable = str(expr.xreplace({sym: sympy.Symbol(names[sym]) for sym in free}))
            guards.append(ShapeGuard(readable, tuple(broken)))
    return guards


def _dim_symbols(program: Any, graph: GraphSpec) -> dict[Any, str]:
    """Each size symbol of the program's inputs and the graph dim it stands for."""
    user = list(program.graph_signature.user_inputs)
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    out: dict[Any, str] = {}
    for name, spec in zip(user, graph.inputs):
        node = placeholders.get(name)
        value = node.meta.get("val") if node is not None else None
        if not isinstance(value, torch.Tensor):
            continue
        for axis, dim in enumerate(spec.dims):
            if dim is None or dim not in graph.dims or axis >= value.dim():
                continue
            size = value.shape[axis]
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                out.setdefault(size.node.expr, dim)
    return out


def _finite(bound: Any) -> int | None:
    try:
        return int(bound)
    except (TypeError, ValueError, OverflowError):  # sympy's infinities
        return None


def _breaking(expr: Any, sym: Any, env: dict[Any, Any], rng: Any) -> list[int]:
    """Sizes of ``sym`` in ``rng`` at which ``expr`` is false (the others at their traced sizes),
    the nearest the traced size first: the range's ends, the constants of ``expr`` and their
    neighbours, and one period of any modulus past the traced size."""
    import sympy

    base = int(env.get(sym, rng.opt))
    candidates = {rng.min, rng.max, base - 2, base - 1, base + 1, base + 2}
    for atom in expr.atoms(sympy.Integer):
        c = int(atom)
        candidates |= {c - 1, c, c + 1}
        if 1 < c <= 64:
            candidates |= {base + i for i in range(1, c + 1)}
    out = []
    for v in sorted((v for v in candidates if rng.min <= v <= rng.max), key=lambda v: (abs(v - base), v)):
        try:
            holds = expr.xreplace({**env, sym: sympy.Integer(v)})
        except Exception:
            continue
        if holds is sympy.false:
            out.append(v)
            if len(out) == MAX_PROBES:
                break
    return out


def runnable(program: Any) -> Callable[..., Any]:
    """``program`` as the ONNX graph made from it computes: its runtime assertions and input range
    checks dropped (the ONNX graph has neither), so it runs on either side of a guard."""
    module = program.module(check_guards=False)
    for key, hook in list(module._forward_pre_hooks.items()):
        if getattr(hook, "__name__", "") == "_check_input_constraints_pre_hook":
            del module._forward_pre_hooks[key]
    for node in list(module.graph.nodes):
        if node.target is torch.ops.aten._assert_scalar.default:
            module.graph.erase_node(node)
    module.graph.eliminate_dead_code()
    module.recompile()
    return module


def sizes_past(
    guards: Sequence[ShapeGuard], graph: GraphSpec, sample: Sample, sizes: dict[str, int]
) -> list[tuple[str, Sample]]:
    """Inputs on the other side of each guard: ``sample`` resized, every other dim at its traced size."""
    out = []
    for guard in guards:
        for other in guard.other_side:
            label = ", ".join(f"{n}={v}" for n, v in other.items())
            out.append((f"{label}, past {guard.condition}", resize(graph, sample, {**sizes, **other})))
    return out


def judge_guards(
    program: Any,
    eager: Callable[..., Any],
    graph: GraphSpec,
    sample: Sample,
    sizes: dict[str, int],
) -> tuple[str | None, list[dict[str, Any]]]:
    """Why an exported program may not be kept (None: it may), and per guard what was run.

    ``eager`` takes the graph's flat input tensors and returns flat output tensors; ``sample`` is at
    ``sizes``, where the program was traced. Each guard's other side must answer as eager there.
    """
    guards = shape_guards(program, graph, sizes)
    if not guards:
        return None, []
    run = runnable(program)
    for guard in guards:
        for what, probe in sizes_past([guard], graph, sample, sizes):
            flat = graph.flatten(probe.args, probe.kwargs)
            with torch.no_grad():
                try:
                    expected = eager(*flat)
                except Exception:  # a size the model itself refuses shows nothing about the export
                    continue
                try:
                    actual = run(*flat)
                except Exception as exc:
                    return f"the exported graph fails at {what} ({type(exc).__name__}: {clip(str(exc), 200)})", []
            differs = _difference(actual, expected)
            if differs is not None:
                return f"at {what}, it differs from eager: {differs}", []
    summary = [
        {
            "site": guard.condition,
            "kind": "size",
            "traced": None,
            "other_side": "; ".join(what for what, _ in sizes_past([guard], graph, sample, sizes)),
            "other_side_checked": True,
        }
        for guard in guards
    ]
    return None, summary
