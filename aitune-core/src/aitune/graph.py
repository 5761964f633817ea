"""Graphs: one input structure of a module, with the ranges its axes take.

A *graph* is what one backend build covers: the tree of inputs (tensor paths, ranks, dtypes,
devices, non-tensor values) plus, for every axis that varies, a named symbolic dimension with
min/opt/max. ``batch`` is the shared batch dimension; other varying axes are grouped into ``d0``,
``d1``... (axes of different inputs that always take the same value share a name, as sequence
length does across ``input_ids`` and ``attention_mask``; two axes of one input never share one by
accident, so square images keep height and width apart unless a ``DynamicDim`` name ties them). Exporters turn names into ``torch.export.Dim`` s and
TensorRT optimisation profiles; the dispatcher checks calls against the ranges.

Each input also keeps what values it took while tuning (:class:`ValueFacts`: an integer's range,
whether floats were all finite), so inputs made without a recorded sample (``ait.load``'s check
against eager, a refit's check, a backend's warm-up: :meth:`GraphSpec.example`) look like real ones.

Here: the specs (:class:`GraphSpec`, :class:`TensorSpec`, :class:`DimRange`, :class:`ValueFacts`),
their inference from recorded samples (:func:`infer_graph`), and the samples made at other sizes
(:func:`resize`, :func:`assemble`) that export, validation and profiling run.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from . import tree
from .errors import InputError

BATCH = "batch"


@attrs.frozen
class DynamicDim:
    """Declares an axis dynamic, optionally bounded: ``DynamicDim("seq", 1, 512)``, AITune's order.

    Axes declared with the same ``name`` share one symbolic dimension (two inputs with one
    sequence length). The keyword form ``DynamicDim(min=1, max=512)`` leaves the name to aitune.
    """

    name: str | None = None
    min: int | None = None
    max: int | None = None
    opt: int | None = None

    def __attrs_post_init__(self) -> None:
        _check_name(self.name, "DynamicDim", "DynamicDim(name, min, max, opt=None)", "DynamicDim(min=1, max=512)")
        if self.name == BATCH:
            raise InputError(f"DynamicDim({BATCH!r}, ...): the name {BATCH!r} is the batch axis; use BatchDim for it")
        _check_bounds(self.min, self.opt, self.max, type(self).__name__)


@attrs.frozen
class BatchDim:
    """Declares the batch axis of an input, optionally with the batch range to build for.

    ``BatchDim("batch", 1, 64)`` (AITune's order) or ``BatchDim(max=64)``. A module has one batch
    dimension: every ``BatchDim`` of its inputs is that one axis.
    """

    name: str | None = None
    min: int | None = None
    max: int | None = None

    def __attrs_post_init__(self) -> None:
        _check_name(self.name, "BatchDim", "BatchDim(name, min, max)", "BatchDim(max=64)")
        _check_bounds(self.min, None, self.max, type(self).__name__)


def _check_name(name: object, what: str, signature: str, keywords: str) -> None:
    if name is not None and not isinstance(name, str):
        raise InputError(
            f"{what}({name!r}, ...): the first argument is the name, as in AITune's {signature}; "
            f"to give bounds alone write {keywords}"
        )


def _check_bounds(lo: int | None, opt: int | None, hi: int | None, what: str) -> None:
    for label, v in (("min", lo), ("opt", opt), ("max", hi)):
        if v is not None and v < 0:
            raise InputError(f"{what}({label}={v}): bounds must be >= 0")
    if lo is not None and hi is not None and lo > hi:
        raise InputError(f"{what}(min={lo}, max={hi}): min is larger than max")
    if opt is not None and ((lo is not None and opt < lo) or (hi is not None and opt > hi)):
        raise InputError(f"{what}(min={lo}, opt={opt}, max={hi}): opt lies outside [min, max]")
    if opt == 0:  # an artifact refuses it (artifact.bounds): an empty example checks nothing
        raise InputError(f"{what}(opt=0): opt is the size backends build for and checks run at; give it at least 1")


AxisDecl = DynamicDim | BatchDim | int
"""What one axis can be declared as: dynamic, the batch axis, or a static size checked on record."""
DynamicShapes = Mapping[str, Mapping[int, AxisDecl] | Sequence[AxisDecl | None]]
"""Per forward parameter: an ``{axis: decl}`` mapping, or AITune's tuple with one entry per axis."""


@attrs.frozen
class DimRange:
    """The range one symbolic dimension takes."""

    min: int
    opt: int
    max: int

    def __contains__(self, value: int) -> bool:
        return self.min <= value <= self.max


@attrs.frozen
class ValueFacts:
    """What values one input took in the calls ``ait.tune`` recorded.

    Inputs made without a recorded sample are drawn from these (:meth:`GraphSpec.example`), so
    ``ait.load``'s check runs token ids through the vocabulary seen and masks that pad some
    positions, not all-zero ids and an all-zero mask that no real call has.
    """

    low: int | None = None
    high: int | None = None
    """Integer and bool inputs: the smallest and largest value seen (bools as 0 and 1); None for
    floating inputs and for an integer input that was always empty."""
    finite: bool = True
    """Floating inputs: no infinity was seen (NaN inputs are refused while recording)."""
    rows: int | None = None
    """Integer inputs that an ``nn.Embedding`` (or ``EmbeddingBag``) of the module indexes as they
    are: that table's rows (the fewest, where several do), so values in ``0..rows-1`` are ids eager
    takes though tuning never saw them; None where tuning saw no table index it."""

    @property
    def mask(self) -> bool:
        """Only 0 and 1 were seen, both: a mask (attention, padding), drawn mostly ones."""
        return self.low == 0 and self.high == 1

    @property
    def accepted(self) -> tuple[int, int | None] | None:
        """The values a call of a tuned backend may hold, ``(low, high)`` (high None: no upper end), or
        None when any value may reach it. A backend's gather wraps a negative id where eager raises, so
        an input that tuning never saw below 0 accepts ``0..``, up to ``rows - 1`` where a table's size
        is known; the upper end is the table's, not the largest id seen, which would send ids that
        tuning happened not to see to eager. An input seen negative indexes nothing as it is, nor does
        a 0/1 mask that no table indexes (it multiplies), and checking it would cost every call."""
        if self.low is None or self.low < 0 or (self.rows is None and self.mask):
            return None
        return 0, None if self.rows is None else self.rows - 1

    @classmethod
    def of(cls, tensor: torch.Tensor) -> ValueFacts:
        """The facts of one tensor's values (none for a dtype torch cannot reduce, a quantized one)."""
        t = tensor.detach()
        try:
            if t.is_floating_point() or t.is_complex():
                return cls(finite=bool(torch.isfinite(t).all()))
            if t.numel() == 0:
                return cls()
            if t.dtype == torch.bool:
                return cls(low=0 if bool((~t).any()) else 1, high=1 if bool(t.any()) else 0)
            low, high = torch.aminmax(t.reshape(-1).to(torch.int64))
            return cls(low=int(low), high=int(high))
        except (RuntimeError, TypeError, NotImplementedError):
            return cls()

    def merge(self, other: ValueFacts | None) -> ValueFacts:
        """The facts of both calls' values together."""
        if other is None:
            return self
        lows = [v for v in (self.low, other.low) if v is not None]
        highs = [v for v in (self.high, other.high) if v is not None]
        rows = [v for v in (self.rows, other.rows) if v is not None]
        return ValueFacts(
            low=min(lows) if lows else None,
            high=max(highs) if highs else None,
            finite=self.finite and other.finite,
            rows=min(rows) if rows else None,
        )


def merge_facts(seen: Sequence[ValueFacts | None], tensors: Sequence[torch.Tensor]) -> list[ValueFacts | None]:
    """``seen`` (one entry per input, or empty for none yet) with one more call's flat input tensors."""
    fresh = [ValueFacts.of(t) for t in tensors]
    if len(seen) != len(fresh):
        return list(fresh)
    return [f.merge(s) for f, s in zip(fresh, seen)]


@attrs.frozen
class TensorSpec:
    """One tensor input or output of a graph."""

    path: str
    dtype: str
    device: str
    shape: tuple[int, ...]
    """Sizes of static axes; for a dynamic axis, its opt value."""
    dims: tuple[str | None, ...]
    """Per axis: the symbolic dimension's name, or None when the axis is static."""
    values: ValueFacts | None = None
    """What values this input took while tuning; None for outputs and in artifacts saved before
    aitune recorded it (inputs made for them are zeros for integers, ones for bools)."""

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def batch_axis(self) -> int | None:
        return self.dims.index(BATCH) if BATCH in self.dims else None

    @property
    def dynamic_axes(self) -> tuple[int, ...]:
        return tuple(i for i, d in enumerate(self.dims) if d is not None)


@attrs.frozen
class Sample:
    """One recorded call, canonical form: positional parameters in ``args``, the rest in ``kwargs``."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = attrs.field(factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        return tree.flatten((self.args, self.kwargs))[0]

    def fresh(self) -> Sample:
        """A deep copy, for a call that may update its inputs in place (a static KV cache): the
        recorded sample stays as it was before the call."""
        return Sample(copy.deepcopy(self.args), copy.deepcopy(self.kwargs))


@attrs.frozen
class Miss:
    """One way a call falls outside a graph, and what would cover it (:meth:`GraphSpec.misses`)."""

    text: str
    path: str | None = None
    axis: int | None = None
    dim: str | None = None
    """The named dimension whose range the call's ``size`` is outside of; None for any other miss
    (a rank, a static size, two tied axes that differ)."""
    size: int | None = None


@attrs.frozen
class GraphSpec:
    """One input structure of a module and the ranges of its dynamic axes."""

    arg_names: tuple[str, ...]
    """Names of the positional parameters, used to name tensor paths."""
    structure: dict[str, Any]
    """Tree of ``(args, kwargs)`` as :mod:`aitune.tree` writes it."""
    inputs: tuple[TensorSpec, ...]
    dims: dict[str, DimRange] = attrs.field(factory=dict)
    output_structure: dict[str, Any] | None = None
    outputs: tuple[TensorSpec, ...] = ()
    mutated: tuple[str, ...] = ()
    """Paths of the inputs a call updates in place (a static KV cache): only a backend that
    supports input mutation can run this graph, and validation compares them after the call."""

    @property
    def key(self) -> str:
        """A short stable digest of the structure, dtypes, devices and static sizes."""
        payload = json.dumps(
            [self.structure, [(t.path, t.dtype, t.device, t.shape, t.dims) for t in self.inputs]],
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:12]

    def without_values(self) -> GraphSpec:
        """This graph with no recorded values: what a build depends on. Keys that must not change with
        the data's values (a build cache's, a remembered JIT decision's, the ranks' agreement) use it."""
        return attrs.evolve(self, inputs=tuple(attrs.evolve(spec, values=None) for spec in self.inputs))

    def with_rows(self, rows: Sequence[int | None]) -> GraphSpec:
        """This graph with, per input, the rows of the embedding table it indexes (None: none seen);
        ``rows`` of another length than the inputs (nothing was found) leave it as it is."""
        if len(rows) != len(self.inputs) or all(r is None for r in rows):
            return self
        inputs = tuple(
            attrs.evolve(spec, values=attrs.evolve(spec.values, rows=r))
            if r is not None and spec.values is not None
            else spec
            for spec, r in zip(self.inputs, rows)
        )
        return attrs.evolve(self, inputs=inputs)

    @property
    def counters(self) -> tuple[str, ...]:
        """Paths of the inputs that are a state's step counters (see :mod:`aitune.state`): ints a
        compiled graph must not specialise on, carried as 0-d tensors."""
        kinds = tree.leaf_kinds(self.structure)
        return tuple(spec.path for spec, kind in zip(self.inputs, kinds) if kind == "counter")

    @property
    def batch(self) -> DimRange | None:
        return self.dims.get(BATCH)

    @property
    def is_dynamic(self) -> bool:
        return any(r.min != r.max for r in self.dims.values()) or BATCH in self.dims

    def flatten(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
        return tree.flatten((tuple(args), dict(kwargs)))[0]

    def unflatten(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs = tree.unflatten(self.structure, list(tensors))
        return tuple(args), dict(kwargs)

    def unflatten_outputs(self, tensors: Sequence[torch.Tensor]) -> Any:
        if self.output_structure is None:
            raise InputError("graph has no recorded output structure")
        return tree.unflatten(self.output_structure, list(tensors))

    def shape_at(self, spec: TensorSpec, which: str) -> tuple[int, ...]:
        """The shape of ``spec`` with every dynamic axis at its ``min``, ``opt`` or ``max``."""
        return tuple(
            size if name is None else getattr(self.dims[name], which) for size, name in zip(spec.shape, spec.dims)
        )

    def mismatch(self, tensors: Sequence[torch.Tensor]) -> str | None:
        """Why these flat input tensors fall outside this graph and what would cover them, or None
        when they fit (the first of :meth:`misses`; for several routes, :func:`outside`)."""
        return next((m.text for m in self.misses(tensors)), None)

    def misses(self, tensors: Sequence[torch.Tensor]) -> Iterator[Miss]:
        """Every way these flat input tensors fall outside this graph, in input and axis order."""
        if len(tensors) != len(self.inputs):
            yield Miss(f"expected {len(self.inputs)} tensors, got {len(tensors)}")
            return
        seen: dict[str, tuple[int, str, int]] = {}
        for t, spec in zip(tensors, self.inputs):
            if t.dim() != spec.rank:
                yield Miss(
                    f"{spec.path}: rank {t.dim()}, tuned for rank {spec.rank}; record a call of that rank while tuning"
                )
                continue
            for axis, (size, static, name) in enumerate(zip(t.shape, spec.shape, spec.dims)):
                if name is None:
                    if size != static:
                        lo, hi = min(size, static), max(size, static)
                        yield Miss(
                            f"{spec.path}: axis {axis} is {size}, tuned for the static size {static}; record calls "
                            f"of both sizes while tuning, or declare the axis dynamic: dynamic_shapes="
                            f"{{{spec.path!r}: {{{axis}: ait.DynamicDim(min={lo}, max={hi})}}}}"
                        )
                    continue
                rng = self.dims[name]
                if size not in rng:
                    yield Miss(_outside_range(spec.path, axis, name, size, [rng]), spec.path, axis, name, size)
                    continue
                first = seen.setdefault(name, (size, spec.path, axis))
                if first[0] != size:
                    yield Miss(
                        f"{spec.path}: axis {axis} ({name}) is {size} but {first[1]} axis {first[2]} is {first[0]}, "
                        "and every tuned call had them equal; record calls where they differ while tuning, or "
                        "declare them as two ait.DynamicDim names"
                    )

    def differences(self, structure: dict[str, Any], tensors: Sequence[torch.Tensor]) -> list[str]:
        """What a call of another input structure has that this graph's calls did not, one phrase
        each: a keyword passed or left out, a value, a container, a cache attribute, a tensor's dtype,
        rank or device. ``structure`` and ``tensors`` are the call's, in this graph's form."""
        out: list[str] = []
        call_args, call_kwargs = structure["items"]
        tuned_args, tuned_kwargs = self.structure["items"]
        if len(call_args["items"]) != len(tuned_args["items"]):
            out.append(f"{len(call_args['items'])} positional arguments, tuned with {len(tuned_args['items'])}")
        for i, (tuned, call) in enumerate(zip(tuned_args["items"], call_args["items"])):
            _differences(tuned, call, self.arg_names[i] if i < len(self.arg_names) else f"args.{i}", out)
        _keyed_differences(tuned_kwargs, call_kwargs, "", out, "the keyword")
        paths = leaf_paths(self.arg_names, structure)
        if not out and paths == [spec.path for spec in self.inputs]:
            for t, spec in zip(tensors, self.inputs):
                dtype = str(t.dtype).removeprefix("torch.")
                if dtype != spec.dtype:
                    out.append(f"{spec.path} is {dtype}, tuned with {spec.dtype}")
                if t.dim() != spec.rank:
                    out.append(f"{spec.path} has rank {t.dim()} {tuple(t.shape)}, tuned with rank {spec.rank}")
                if t.device.type != spec.device:
                    out.append(f"{spec.path} is on {t.device.type}, tuned on {spec.device}")
        return out

    def example(
        self, which: str = "opt", batch_size: int | None = None, *, row: int = 0, shuffled: bool = False
    ) -> Sample:
        """Inputs of this graph with every dynamic axis at ``which`` (or a given batch size), their
        values drawn from what each input took while tuning (:func:`draw`): the same for the same
        arguments. ``row`` numbers the first row, so successive examples sweep on where the last
        stopped; ``shuffled`` draws integers and mask padding at random instead of sweeping."""
        generator = torch.Generator().manual_seed(2 * row + shuffled)
        tensors = []
        for spec in self.inputs:
            shape = list(self.shape_at(spec, which))
            if batch_size is not None and spec.batch_axis is not None:
                shape[spec.batch_axis] = batch_size
            tensors.append(draw(spec, tuple(shape), row, generator, shuffled))
        args, kwargs = self.unflatten(tensors)
        return Sample(args, kwargs)


def narrow(graph: GraphSpec, batch_min: int, batch_max: int) -> GraphSpec:
    """``graph`` with its batch dimension limited to ``batch_min..batch_max``."""
    full = graph.dims[BATCH]
    opt = min(max(full.opt, batch_min), batch_max)
    return attrs.evolve(graph, dims={**graph.dims, BATCH: DimRange(batch_min, opt, batch_max)})


def outside(graphs: Sequence[GraphSpec], tensors: Sequence[torch.Tensor]) -> str:
    """Why a call fits none of ``graphs``, the routes of one input structure (the batch ranges of one
    graph, a static build beside a dynamic one), and what would cover it.

    A route with a range that a size of the call is outside of, while another route's range holds
    that size, is not the call's route: what it lacks is left unsaid (widening that range would not
    serve the call), only what the routes that hold the call's sizes lack. A size outside every
    route's range is said once, against all their ranges (``tuned for 1..1, 4..8``). Empty when a
    route takes the call.
    """
    found = [list(g.misses(tensors)) for g in graphs]
    if not all(found):  # a route takes it (or there is none)
        return ""

    def ranges(dim: str) -> list[DimRange]:
        return [g.dims[dim] for g in graphs if dim in g.dims]

    def held(miss: Miss) -> bool:
        return miss.dim is not None and miss.size is not None and any(miss.size in r for r in ranges(miss.dim))

    routes = [misses for misses in found if not any(held(m) for m in misses)] or found
    firsts = [misses[0] for misses in routes]
    places = {(m.path, m.axis, m.dim, m.size) for m in firsts}
    if len(firsts) > 1 and len(places) == 1:
        m = firsts[0]
        if m.path is not None and m.axis is not None and m.dim is not None and m.size is not None:
            return _outside_range(m.path, m.axis, m.dim, m.size, ranges(m.dim))
    return "; ".join(dict.fromkeys(m.text for m in firsts))


def _outside_range(path: str, axis: int, dim: str, size: int, ranges: Sequence[DimRange]) -> str:
    """``size`` on ``path``'s ``axis`` is in none of ``ranges`` (those of ``dim``): what would cover it."""
    spans: list[list[int]] = []
    for r in sorted(ranges, key=lambda r: (r.min, r.max)):
        if spans and r.min <= spans[-1][1] + 1:
            spans[-1][1] = max(spans[-1][1], r.max)
        else:
            spans.append([r.min, r.max])
    tuned = ", ".join(f"{lo}..{hi}" for lo, hi in spans)
    lo, hi = min(spans[0][0], size), max(spans[-1][1], size)
    kind = "BatchDim" if dim == BATCH else "DynamicDim"
    return (
        f"{path}: axis {axis} ({dim}) is {size}, tuned for {tuned}; record a call of that size while tuning, "
        f"or widen the range: dynamic_shapes={{{path!r}: {{{axis}: ait.{kind}(min={lo}, max={hi})}}}}"
    )


def _what(node: dict[str, Any]) -> str:
    """A structure node in a few words: ``a tensor``, ``None``, ``a list of 2``, ``a DynamicCache``."""
    kind = node["kind"]
    if kind == "tensor":
        return "a tensor"
    if kind == "const":
        return repr(node["value"])
    if kind == "enum":
        return f"{node['type'].rpartition(':')[2]}.{node['name']}"
    if "type" in node:
        return f"a {node['type'].rpartition(':')[2]}"
    return f"a {kind} of {len(node['items'])}"


def _differences(tuned: dict[str, Any], call: dict[str, Any], where: str, out: list[str]) -> None:
    """Append where ``call``'s structure node differs from ``tuned``'s."""
    if tuned["kind"] != call["kind"] or tuned.get("type") != call.get("type"):
        out.append(f"{where} is {_what(call)}, tuned with {_what(tuned)}")
        return
    kind = call["kind"]
    if kind in ("const", "enum"):
        if tuned != call:
            out.append(f"{where} is {_what(call)}, tuned with {_what(tuned)}")
        return
    if kind == "pytree" and tuned["context"] != call["context"]:
        out.append(f"{where} ({_what(call)}) has another layout than when tuned")
        return
    if kind == "state":
        for attr in sorted(set(tuned["attrs"]) | set(call["attrs"])):
            mine, theirs = call["attrs"].get(attr), tuned["attrs"].get(attr)
            if mine != theirs:
                out.append(f"{where}.{attr} is {mine!r}, tuned with {theirs!r}")
    if "keys" in call:
        _keyed_differences(tuned, call, where, out)
        return
    if "items" in call:
        if len(call["items"]) != len(tuned["items"]):
            out.append(f"{where} has {len(call['items'])} items, tuned with {len(tuned['items'])}")
            return
        for i, (t, c) in enumerate(zip(tuned["items"], call["items"])):
            _differences(t, c, f"{where}.{i}", out)


def _keyed_differences(
    tuned: dict[str, Any], call: dict[str, Any], where: str, out: list[str], label: str = "the key"
) -> None:
    prefix = f"{where}." if where else ""
    tuned_items = dict(zip(tuned["keys"], tuned["items"]))
    call_items = dict(zip(call["keys"], call["items"]))
    for key, node in call_items.items():
        if key not in tuned_items:
            out.append(f"{label} {prefix}{key} ({_what(node)}) was never passed while tuning")
        else:
            _differences(tuned_items[key], node, f"{prefix}{key}", out)
    for key, node in tuned_items.items():
        if key not in call_items:
            out.append(f"{label} {prefix}{key} is missing, tuned calls passed {_what(node)}")


class FlatModule(torch.nn.Module):
    """``module`` as a function of ``graph``'s flat input tensors returning its flat output tensors.

    Exporters (ONNX, ``torch.export``) see one tensor per input in ``graph.inputs`` order, whatever
    the module's signature (``**kwargs``, keyword-only parameters, constants): the call is rebuilt
    from the graph's structure, made the way it was recorded. The owner puts the output structure
    back with ``graph.unflatten_outputs``.
    """

    def __init__(self, module: torch.nn.Module, graph: GraphSpec) -> None:
        super().__init__()
        self.module = module
        self.graph = graph

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = self.graph.unflatten(tensors)
        return tuple(tree.flatten(self.module(*args, **kwargs))[0])


_INDEX_CAP = 1 << 62
"""Sweeps index a range through int64 arithmetic: a wider range is swept over its first 2**62 values."""


def draw(
    spec: TensorSpec,
    shape: tuple[int, ...],
    row: int = 0,
    generator: torch.Generator | None = None,
    shuffled: bool = False,
) -> torch.Tensor:
    """Values for one input of ``shape``, made like those it took while tuning (``spec.values``).

    Rows are the positions of every axis but the last; ``row`` numbers the first. Floats are
    normal. A 0/1 input (a mask) is ones with the last ``r % (length // 2 + 1)`` positions of row
    ``r`` zero, so no row is all padding (an all-zero attention mask is a case no model is built
    for, and backends answer it differently). Other integers sweep their recorded range: position ``j``
    of row ``r`` takes the ``(r + j)``-th value counted from both ends inward (low, high, low+1,
    high-1, ...), so the first position runs through both ends first and a range no wider than
    the rows swept is drawn whole at every position. ``shuffled``: integers and padding uniformly
    random instead. Without recorded facts (an older artifact): integers zero, bools one.
    """
    dtype = spec.torch_dtype
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=generator).to(spec.device)
    facts = spec.values
    if facts is None or facts.low is None or facts.high is None:
        fill = 1 if dtype == torch.bool else 0
        return torch.full(shape, fill, dtype=dtype, device=spec.device)
    lo, hi = facts.low, facts.high
    length = shape[-1] if shape else 1
    rows = math.prod(shape[:-1]) if shape else 1
    if rows * length == 0:
        return torch.zeros(shape, dtype=dtype, device=spec.device)
    r = torch.arange(rows).unsqueeze(1) + row
    j = torch.arange(length).unsqueeze(0)
    if facts.mask:
        most = length // 2 + 1  # at most half of a row is padding
        padded = torch.randint(0, most, (rows, 1), generator=generator) if shuffled else r % most
        values = (j < length - padded).to(torch.int64)
    else:
        span = min(hi - lo + 1, _INDEX_CAP)
        if shuffled:
            values = lo + torch.randint(0, span, (rows, length), generator=generator)
        else:
            index = (r + j) % span
            values = torch.where(index % 2 == 0, lo + index // 2, hi - index // 2)
    return values.reshape(shape).to(dtype=dtype, device=spec.device)


def leaf_paths(arg_names: Sequence[str], structure: dict[str, Any]) -> list[str]:
    """Tensor paths named after parameters: ``x``, ``inputs.mask``, ``args.2`` for unnamed ones."""
    args_node, kwargs_node = structure["items"]
    paths: list[str] = []
    for i, node in enumerate(args_node["items"]):
        name = arg_names[i] if i < len(arg_names) else f"args.{i}"
        paths += [f"{name}.{q}" if q else name for q in tree.leaf_paths(node)]
    for key, node in zip(kwargs_node["keys"], kwargs_node["items"]):
        paths += [f"{key}.{q}" if q else key for q in tree.leaf_paths(node)]
    return paths


def infer_graph(
    samples: Sequence[Sample],
    arg_names: Sequence[str] = (),
    dynamic_shapes: DynamicShapes | None = None,
    batch_sizes: Sequence[int] | None = None,
    outputs: Sequence[Any] | None = None,
    facts: Sequence[ValueFacts | None] | None = None,
) -> GraphSpec:
    """Build the graph that covers ``samples`` (all of one structure).

    The batch axis is axis 0 of the inputs whose leading size varies together across samples
    (or, with one recorded batch size and ``batch_sizes`` given, of the inputs sharing the leading
    size). Other varying axes become dynamic; ``dynamic_shapes`` states axes explicitly and is
    checked against every sample. Each range's opt is its most common recorded size, a positive
    one where there is one (an empty example checks nothing). ``facts``: per input, what values
    every recorded call took (:attr:`GraphRecording.values <aitune.engine.recording.GraphRecording.values>`);
    left None, those of ``samples``.
    """
    if not samples:
        raise InputError("no samples recorded for this graph; run the model on at least one input")
    flat = [tree.flatten((s.args, s.kwargs)) for s in samples]
    structure = flat[0][1]
    for i, (_, st) in enumerate(flat[1:], 1):
        if st != structure:
            raise InputError(f"sample {i} has another input structure than sample 0; group samples by structure")
    leaves = [f[0] for f in flat]
    paths = leaf_paths(arg_names, structure)
    declared = _declared(dynamic_shapes or {}, paths, leaves[0])
    sizes = [[tuple(t.shape) for t in sample] for sample in leaves]  # [sample][leaf] -> shape
    n_leaves = len(paths)

    batch_leaves = _batch_leaves(sizes, n_leaves, declared, bool(batch_sizes))
    names: list[list[str | None]] = [[None] * len(sizes[0][i]) for i in range(n_leaves)]
    ranges: dict[str, list[int]] = {}
    bounds: dict[str, tuple[int | None, int | None, int | None]] = {}

    for i in batch_leaves:
        names[i][0] = BATCH
    if batch_leaves:
        ranges[BATCH] = [sizes[s][batch_leaves[0]][0] for s in range(len(samples))]

    groups: dict[tuple[tuple[int, ...], int], str] = {}
    owner: dict[tuple[tuple[int, ...], int], int] = {}  # the input whose axis made each group
    for i in range(n_leaves):
        repeats: collections.Counter[tuple[int, ...]] = collections.Counter()  # of one tensor's own axes
        for axis in range(len(sizes[0][i])):
            values = [sizes[s][i][axis] for s in range(len(samples))]
            decl = declared.get((i, axis))
            if isinstance(decl, int):
                wrong = next((v for v in values if v != decl), None)
                if wrong is not None:
                    raise InputError(
                        f"dynamic_shapes says input {paths[i]!r} axis {axis} is {decl}, but a recorded sample "
                        f"has {wrong}: declare it a DynamicDim, or record samples of that size"
                    )
                continue
            if isinstance(decl, BatchDim):
                names[i][axis] = BATCH
                ranges.setdefault(BATCH, values)
                bounds[BATCH] = (decl.min, None, decl.max)
                continue
            if names[i][axis] == BATCH:
                continue
            if decl is None and len(set(values)) == 1:
                continue
            if decl is not None and decl.name:
                name = decl.name
            else:
                # equal values tie axes of different inputs (a sequence length); within one input, the
                # k-th axis with these values joins the k-th of the others, so a square image's height
                # and width stay two dims (a DynamicDim name ties them on purpose). An input with more
                # such axes than any before it (a [batch, 1, seq, seq] mask beside [batch, seq, hidden]
                # states) ties the extra ones to the first: another input's axis says they are one length.
                nth = repeats[tuple(values)]
                repeats[tuple(values)] += 1
                key = (tuple(values), nth)
                first = (tuple(values), 0)
                if key not in groups and first in groups and owner[first] != i:
                    key = first
                if key not in groups:
                    groups[key], owner[key] = f"d{len(groups)}", i
                name = groups[key]
            names[i][axis] = name
            ranges.setdefault(name, values)
            if decl is not None:
                bounds[name] = (decl.min, decl.opt, decl.max)

    if batch_sizes and BATCH in ranges:
        ranges[BATCH] = ranges[BATCH] + list(batch_sizes)
    dims: dict[str, DimRange] = {}
    for name, values in ranges.items():
        lo, opt, hi = bounds.get(name, (None, None, None))
        rec_lo, rec_hi = min(values), max(values)
        for i in range(n_leaves):
            for axis, n in enumerate(names[i]):
                if n == name:
                    for v in (sizes[s][i][axis] for s in range(len(samples))):
                        if (lo is not None and v < lo) or (hi is not None and v > hi):
                            raise InputError(
                                f"input {paths[i]!r} axis {axis} took the value {v} in a recorded sample, "
                                f"outside the declared bounds [{lo}, {hi}] of {name!r}: widen the bounds "
                                "or record samples inside them"
                            )
        counts = collections.Counter(values)
        common = max((v for v in counts if v > 0), key=counts.__getitem__, default=0)
        dims[name] = DimRange(
            min=rec_lo if lo is None else lo, opt=common if opt is None else opt, max=rec_hi if hi is None else hi
        )

    seen: list[ValueFacts | None] = list(facts) if facts is not None and len(facts) == n_leaves else []
    if not seen:
        for sample in leaves:
            seen = merge_facts(seen, sample)
    inputs = tuple(
        TensorSpec(
            path=paths[i],
            dtype=str(leaves[0][i].dtype).removeprefix("torch."),
            device=leaves[0][i].device.type,
            shape=tuple(dims[n].opt if n is not None else size for size, n in zip(sizes[0][i], names[i])),
            dims=tuple(names[i]),
            values=seen[i],
        )
        for i in range(n_leaves)
    )
    out_structure: dict[str, Any] | None = None
    out_specs: tuple[TensorSpec, ...] = ()
    if outputs:
        out_structure, out_specs = _output_specs(outputs)
    return GraphSpec(
        arg_names=tuple(arg_names),
        structure=structure,
        inputs=inputs,
        dims=dims,
        output_structure=out_structure,
        outputs=out_specs,
    )


def _declared(
    dynamic_shapes: DynamicShapes, paths: list[str], first: list[torch.Tensor]
) -> dict[tuple[int, int], AxisDecl]:
    """``{(leaf, axis): declaration}`` from either form of ``dynamic_shapes``, checked against the inputs."""
    if not isinstance(dynamic_shapes, Mapping):
        raise InputError(
            f"dynamic_shapes must map parameter names to axes, e.g. {{'x': (BatchDim('batch', 1, 8), 3)}}, "
            f"got {type(dynamic_shapes).__name__}"
        )
    out: dict[tuple[int, int], AxisDecl] = {}
    batch_names: set[str] = set()
    for path, axes in dynamic_shapes.items():
        if path not in paths:
            raise InputError(f"dynamic_shapes names the input {path!r}, but the recorded inputs are {paths}")
        i = paths.index(path)
        rank = first[i].dim()
        if isinstance(axes, Mapping):
            items = list(axes.items())
        elif isinstance(axes, (tuple, list)):
            if len(axes) != rank:
                raise InputError(
                    f"dynamic_shapes[{path!r}] has {len(axes)} entries, but {path!r} has rank {rank} "
                    f"(shape {tuple(first[i].shape)}): give one entry per axis"
                )
            items = [(axis, dim) for axis, dim in enumerate(axes) if dim is not None]
        else:
            raise InputError(
                f"dynamic_shapes[{path!r}] must be a tuple with one entry per axis or an {{axis: dim}} mapping, "
                f"got {type(axes).__name__}"
            )
        for axis, dim in items:
            if not isinstance(dim, (DynamicDim, BatchDim, int)) or isinstance(dim, bool):
                raise InputError(
                    f"dynamic_shapes[{path!r}][{axis}] must be an int, a DynamicDim or a BatchDim, got {dim!r}"
                )
            if not isinstance(axis, int) or not -rank <= axis < rank:
                raise InputError(f"dynamic_shapes[{path!r}] names axis {axis}, but {path!r} has rank {rank}")
            if isinstance(dim, BatchDim) and dim.name is not None:
                batch_names.add(dim.name)
            out[(i, axis % rank)] = dim
    dynamic_names = {d.name for d in out.values() if isinstance(d, DynamicDim) and d.name is not None}
    if len(batch_names) > 1 or batch_names & dynamic_names:
        raise InputError(
            f"dynamic_shapes names the batch axis {sorted(batch_names)} and dynamic axes {sorted(dynamic_names)}: "
            "a module has one batch dimension, so give every BatchDim one name that no DynamicDim uses"
        )
    return out


def _batch_leaves(
    sizes: list[list[tuple[int, ...]]],
    n_leaves: int,
    declared: Mapping[tuple[int, int], AxisDecl],
    batch_requested: bool,
) -> list[int]:
    if any(isinstance(d, BatchDim) for d in declared.values()):
        return []  # explicit batch axes are applied leaf by leaf
    ranked = [i for i in range(n_leaves) if len(sizes[0][i]) >= 1 and (i, 0) not in declared]
    varying = [i for i in ranked if len({s[i][0] for s in sizes}) > 1]
    if varying:
        if all(len({s[i][0] for i in varying}) == 1 for s in sizes):
            return varying
        return []
    if batch_requested and ranked:
        lead = sizes[0][ranked[0]][0]
        return [i for i in ranked if all(s[i][0] == s[ranked[0]][0] for s in sizes) and sizes[0][i][0] == lead]
    return []


def _output_specs(outputs: Sequence[Any]) -> tuple[dict[str, Any], tuple[TensorSpec, ...]]:
    flat = [tree.flatten(o) for o in outputs]
    structure = flat[0][1]
    paths = [p or "output" for p in tree.leaf_paths(structure)]
    specs = []
    for i, path in enumerate(paths):
        shapes = [tuple(f[0][i].shape) for f in flat if len(f[0]) > i]
        first = flat[0][0][i]
        dims = tuple(None if len({s[a] for s in shapes}) == 1 else "dynamic" for a in range(first.dim()))
        specs.append(
            TensorSpec(
                path=path,
                dtype=str(first.dtype).removeprefix("torch."),
                device=first.device.type,
                shape=tuple(first.shape),
                dims=dims,
            )
        )
    return structure, tuple(specs)


def resize(graph: GraphSpec, sample: Sample, sizes: Mapping[str, int]) -> Sample:
    """``sample`` with the named dynamic dimensions set to ``sizes``, reusing its real values.

    Each axis is cycled (``index % old_size``) or cut, so a batch of 8 built from a batch of 3
    holds rows 0, 1, 2, 0, 1, 2, 0, 1: real data, not noise, at the shape a check needs.
    """
    tensors = graph.flatten(sample.args, sample.kwargs)
    out = []
    for t, spec in zip(tensors, graph.inputs):
        for axis, name in enumerate(spec.dims):
            if name is None or name not in sizes or t.shape[axis] == sizes[name]:
                continue
            index = torch.arange(sizes[name], device=t.device) % max(t.shape[axis], 1)
            t = t.index_select(axis, index)
        out.append(t)
    args, kwargs = graph.unflatten(out)
    return Sample(args, kwargs)


def assemble(graph: GraphSpec, samples: Sequence[Sample], sizes: Mapping[str, int]) -> Sample:
    """A sample with the named dimensions at ``sizes``, its batch made of recorded samples.

    As AITune forms a batch of 8 from batch-1 samples, the batch axis is filled by concatenating
    successive recorded samples (cycling when there are too few) whose other sizes match the
    first one's; every other axis is then set by :func:`resize`. With no batch axis, or no
    batch size asked for, this is ``resize`` of the first sample.
    """
    first = samples[0]
    target = sizes.get(BATCH)
    if graph.batch is None or target is None:
        return resize(graph, first, sizes)
    batched = [i for i, spec in enumerate(graph.inputs) if spec.batch_axis is not None]
    base = graph.flatten(first.args, first.kwargs)

    def fits(tensors: list[torch.Tensor]) -> bool:
        return len(tensors) == len(base) and all(
            t.dim() == b.dim() and all(n == BATCH or x == y for x, y, n in zip(t.shape, b.shape, spec.dims))
            for t, b, spec in zip(tensors, base, graph.inputs)
        )

    lead, lead_axis = batched[0], graph.inputs[batched[0]].batch_axis or 0  # its batch axis counts the rows
    pool = [ts for ts in (graph.flatten(s.args, s.kwargs) for s in samples) if fits(ts)]
    pool = [ts for ts in pool if ts[lead].shape[lead_axis] > 0]
    if len(pool) < 2:
        return resize(graph, first, sizes)
    parts: list[list[torch.Tensor]] = []
    rows = 0
    while rows < target:
        tensors = pool[len(parts) % len(pool)]
        parts.append(tensors)
        rows += tensors[lead].shape[lead_axis]
    out = list(base)
    for i in batched:
        axis = graph.inputs[i].batch_axis or 0
        out[i] = torch.cat([p[i] for p in parts], dim=axis).narrow(axis, 0, target)
    args, kwargs = graph.unflatten(out)
    return resize(graph, Sample(args, kwargs), sizes)
