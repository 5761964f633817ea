"""What every serving engine of ``aitune serve`` shares: a loaded artifact's inputs and batch sizes,
and running the tuned model on batches of requests inside those sizes.

The engines (``aitune-serve-kserve`` on one machine, ``aitune-serve-ray`` on a cluster) differ in
their server, protocol and queue, not in what the artifact says about serving it, so that lives once,
here, and each engine keeps only its own side:

- :class:`BatchPlan`: the batch sizes every tuned module covers (its tuned graphs, as ``ait.load``
  installed them from the manifest), and how a call's rows are cut into calls of those sizes: split
  above the largest, padded up to the smallest (or the next range above a gap);
- :func:`input_specs` and :func:`model_graph`: the forward's named inputs, typed and shaped by the
  first tuned graph whose tensors are exactly them, so a request is checked before it joins a batch;
- :class:`Padding`: where the artifact (``ait.tune(pad=...)``) or the server (``aitune serve --pad``)
  says how the model's inputs are padded, requests of different lengths join too: each padded to the
  group's longest length (at least the tuned range's min), its answer cut back to its own length on
  the output axes that follow it (found and checked against the unpadded answer when the server loads,
  :meth:`Padding.probe`);
- :class:`BatchRunner`: requests that agree on everything but the batch size (and, with padding,
  the padded lengths) joined, cut into calls of tuned sizes (the last one padded by repeating its last
  row, the padding's answers dropped) and split back per request; each call observed
  (:func:`observe_routes`), so every answer says which backend served it and why a tuned module ran
  eager; a request the model cannot take fails alone; requests of host numpy arrays (as a server
  decodes them) go through all of it on the arrays, each call through :mod:`aitune.engine.host`'s
  lane where the tuned module's backend runs arrays, so no torch tensor is made on either side;
- :func:`tuned_graphs`, :func:`named_outputs`, :func:`resolve_factory`, :func:`tuned_threads`: every
  tuned graph (what a request is bounded by), outputs as named tensors, the user's model factory, the
  torch threads the artifact was tuned with (read from its manifest by :func:`aitune.artifact.manifest_of`).

No server, protocol or numpy here: importing this module is as light as ``import aitune.torch``.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from ..artifact import manifest_of
from ..engine.dispatch import Route, observe_routes
from ..engine.host import HostLane, host_lane
from ..engine.module import Module
from ..engine.options import check_pad
from ..errors import AituneError, ServeStartError
from ..graph import BATCH, GraphSpec, resize
from ..validation import DEFAULT_TOLERANCES

__all__ = [
    "AituneError",
    "Answer",
    "BatchPlan",
    "BatchRunner",
    "Call",
    "ClientError",
    "Factory",
    "InputSpec",
    "Padding",
    "Ranges",
    "Request",
    "ServeStartError",
    "forward_of",
    "input_specs",
    "intersect",
    "merge",
    "model_graph",
    "named_outputs",
    "parse_pad",
    "resolve_factory",
    "tuned_graphs",
    "tuned_modules",
    "tuned_threads",
]

Factory = Callable[[], torch.nn.Module]
Request = dict[str, Any]
"""Input name -> a torch tensor, or a host numpy array as a server decoded it (a lone request may be
answered from the arrays themselves, :mod:`aitune.engine.host`; any other call gets tensors)."""
Ranges = tuple[tuple[int, int], ...]
"""Sorted, disjoint, inclusive batch-size ranges."""


# -- what the artifact says: batch sizes and inputs --------------------------------------------------------


@attrs.frozen
class BatchPlan:
    """The batch sizes every tuned module of the model covers, and how to cut rows into calls."""

    ranges: Ranges
    """Empty when no tuned module has a batch axis: each request is then one call, as sent."""

    @property
    def max_batch_size(self) -> int:
        return self.ranges[-1][1] if self.ranges else 1

    def chunks(self, rows: int) -> list[tuple[int, int]]:
        """``rows`` cut into calls, each ``(real rows, rows after padding)`` with the padded size tuned."""
        if not self.ranges:
            return [(rows, rows)]
        out = []
        while rows > 0:
            take = min(rows, self.max_batch_size)
            out.append((take, self.padded(take)))
            rows -= take
        return out

    def padded(self, rows: int) -> int:
        """The smallest tuned batch size of at least ``rows`` (``rows`` itself above every range)."""
        for low, high in self.ranges:
            if rows <= high:
                return max(rows, low)
        return rows

    @classmethod
    def of(cls, model: torch.nn.Module) -> BatchPlan:
        """The batch sizes that every tuned module of ``model`` has a route for (winner or eager)."""
        covered: Ranges | None = None
        for module in tuned_modules(model):
            mine = merge((g.batch.min, g.batch.max) for g, _ in module.tuned_graphs if g.batch is not None)
            if mine:
                covered = mine if covered is None else intersect(covered, mine)
        return cls(covered or ())


def tuned_modules(model: torch.nn.Module) -> list[Module]:
    """The tuned ``ait.Module``s in ``model`` (the model itself included), in module order."""
    return [m for m in model.modules() if isinstance(m, Module) and m.state == "tuned"]


def tuned_graphs(model: torch.nn.Module) -> list[GraphSpec]:
    """Every graph the tuned modules in ``model`` were tuned for (what a server bounds requests by),
    in module order, then in each module's order."""
    return [winner.graph for module in tuned_modules(model) for winner in module.tuned_graphs]


def merge(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Overlapping or adjacent ranges joined."""
    out: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return tuple(out)


def intersect(a: Ranges, b: Ranges) -> Ranges:
    """The sizes both range sets cover."""
    return merge((max(x0, y0), min(x1, y1)) for x0, x1 in a for y0, y1 in b if max(x0, y0) <= min(x1, y1))


def _shape(value: int | Sequence[int] | None) -> tuple[int, ...] | None:
    """A shape as given, or a rank: that many axes of any size."""
    if value is None:
        return None
    if isinstance(value, int):
        return (-1,) * value
    return tuple(value)


@attrs.frozen
class InputSpec:
    """One named tensor input a request must send."""

    name: str
    required: bool
    dtype: torch.dtype | None = None
    """None when no tuned graph names this input: any dtype is passed on."""
    shape: tuple[int, ...] | None = attrs.field(default=None, converter=_shape)
    """The tuned shape, -1 on the batch axis and every dynamic axis; None when no tuned graph names it.
    Given as an int, a rank: that many axes of any size."""
    batch_axis: int = 0

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)


def model_graph(model: torch.nn.Module) -> Any:
    """The first tuned graph whose tensors are exactly the model's forward parameters (the model's own
    when the model itself was tuned, else the first tuned module called with the model's inputs
    unchanged, like the demo's ``features``), or None."""
    names = {p.name for p in _parameters(model)}
    for graph in tuned_graphs(model):
        paths = [t.path for t in graph.inputs]
        if paths and set(paths) <= names and len(set(paths)) == len(paths):
            return graph
    return None


def input_specs(model: torch.nn.Module) -> dict[str, InputSpec]:
    """The model's forward parameters, typed and shaped by :func:`model_graph`."""
    graph = model_graph(model)
    typed = {t.path: t for t in graph.inputs} if graph is not None else {}
    specs = {}
    for p in _parameters(model):
        tensor = typed.get(p.name)
        if tensor is None:
            specs[p.name] = InputSpec(p.name, p.default is p.empty)
            continue
        shape = tuple(-1 if dim is not None else size for size, dim in zip(tensor.shape, tensor.dims))
        axis = tensor.batch_axis
        specs[p.name] = InputSpec(p.name, True, tensor.torch_dtype, shape, 0 if axis is None else axis)
    return specs


def forward_of(model: torch.nn.Module) -> Any:
    """The forward whose parameters name the model's inputs (the wrapped one, for a tuned model itself)."""
    return model.module.forward if isinstance(model, Module) else model.forward


def _parameters(model: torch.nn.Module) -> list[inspect.Parameter]:
    return [
        p
        for p in inspect.signature(forward_of(model)).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def named_outputs(output: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """A model's output as named tensors: ``output`` for one tensor, keys for a mapping (a
    ``ModelOutput`` too), ``output_0``... for a sequence, dotted for nested ones; other values dropped."""
    if isinstance(output, torch.Tensor):
        return {prefix or "output": output}
    if isinstance(output, Mapping):
        items = [(str(k), v) for k, v in output.items()]
    elif isinstance(output, (tuple, list)):
        items = [(f"output_{i}" if not prefix else str(i), v) for i, v in enumerate(output)]
    else:
        return {}
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, torch.Tensor):  # the usual leaf, without a call of its own (a server's every answer)
            out[name] = value
        else:
            out.update(named_outputs(value, name))
    return out


# -- requests of different lengths -----------------------------------------------------------------------


@attrs.frozen
class Padding:
    """How requests of different lengths join one call: which inputs are padded with what, on which axes
    (the model graph's dynamic axes other than the batch), and which output axes are cut back.

    Only declared padding is used (``ait.tune(pad=...)``, kept in the artifact, and ``aitune serve
    --pad``), never inferred: a 0/1 input beside the token ids may be an attention mask or token type
    ids, and the id a tokenizer pads with is the model's (0 for BERT, 1 for RoBERTa). A declaration is
    still checked when the server loads (:meth:`probe`): a short example padded to a longer length must
    answer as the short one does, cut back, or padding is not used and :attr:`reason` says why.
    """

    values: dict[str, float] = attrs.field(factory=dict)
    """Input name -> the value its padded positions take (as declared)."""
    axes: dict[str, dict[int, str]] = attrs.field(factory=dict)
    """Padded input -> {axis: the graph's dim name}: the axes a request may be shorter on."""
    ranges: dict[str, tuple[int, int]] = attrs.field(factory=dict)
    """Dim name -> its tuned (min, max): a call is padded up to min, and a longer request joins no one."""
    cuts: dict[str, dict[int, str]] = attrs.field(factory=dict)
    """Output name -> {axis: dim name}: the axes an answer is cut back on to the request's own length."""
    reason: str | None = None
    """Why requests of different lengths do not join (no padding known, ...); None when they do."""
    tuned: frozenset[str] = frozenset()
    """The model graph's inputs: a request sending another one (which the tuned graph never saw, and
    which might hold the length too) joins no one."""

    @property
    def active(self) -> bool:
        return self.reason is None and bool(self.axes)

    def describe(self) -> str:
        """One line for the server's log and answers: what is padded with what, or why nothing is."""
        if not self.active:
            return f"none: {self.reason}"
        return ", ".join(f"{name}={_number(value)}" for name, value in self.values.items())

    @classmethod
    def of(
        cls,
        model: torch.nn.Module,
        specs: Mapping[str, InputSpec],
        declared: Mapping[str, float] | None = None,
    ) -> Padding:
        """The padding ``model``'s tuned modules recorded (``ait.tune(pad=...)``), ``declared`` added over
        it (``aitune serve --pad``), on the axes the model graph has dynamic; :meth:`probe` finds the
        output axes. Raises ``ValueError`` for a name the model does not take."""
        values: dict[str, float] = {}
        for module in tuned_modules(model):
            if module.pad:
                values = dict(module.pad)
                break
        values.update(check_pad(declared, "--pad"))
        unknown = [n for n in values if n not in specs]
        if unknown:
            raise ValueError(
                f"padding names {', '.join(map(repr, unknown))}, which the model does not take; its inputs are "
                f"{', '.join(specs)}"
            )
        values = {name: values[name] for name in specs if name in values}  # in the forward's order
        if not values:
            return cls(
                reason="no padding is known; declare it with ait.tune(..., pad={'input_ids': 0, "
                "'attention_mask': 0}) or aitune serve --pad input_ids=0,attention_mask=0"
            )
        graph = model_graph(model)
        if graph is None:
            return cls(values, reason="no tuned graph takes the model's own inputs, so their padded axes are unknown")
        axes = {
            t.path: {a: d for a, d in enumerate(t.dims) if d is not None and d != BATCH}
            for t in graph.inputs
            if t.path in values
        }
        axes = {name: found for name, found in axes.items() if found}
        dims = {d for found in axes.values() for d in found.values()}
        if not dims:
            return cls(
                values,
                reason="the padded inputs have no dynamic axis in the tuned graph: every request has the tuned length",
            )
        for t in graph.inputs:
            if t.path not in values and any(d in dims for d in t.dims):
                return cls(
                    values,
                    reason=f"{t.path} has the padded length too, and no pad value; declare one for it "
                    f"(--pad {t.path}=VALUE)",
                )
        ranges = {d: (graph.dims[d].min, graph.dims[d].max) for d in sorted(dims)}
        return cls(values, axes, ranges, tuned=frozenset(t.path for t in graph.inputs))

    def lengths(self, request: Request) -> dict[str, int] | None:
        """The request's size on each padded dim; None when its inputs disagree on one, one is outside the
        tuned range, or it sends an input the tuned graph did not take (such a request joins no one: it
        runs as sent)."""
        if not set(request) <= self.tuned:
            return None
        found: dict[str, int] = {}
        for name, axes in self.axes.items():
            tensor = request.get(name)
            if tensor is None:
                return None
            for axis, dim in axes.items():
                if axis >= len(tensor.shape):  # a tensor or a host array
                    return None
                size = tensor.shape[axis]
                high = self.ranges[dim][1]
                if found.setdefault(dim, size) != size or not 1 <= size <= high:
                    return None
        return found

    def target(self, lengths: Iterable[Mapping[str, int]]) -> dict[str, int]:
        """The length each padded dim takes in a call of these requests: the longest, at least the tuned min."""
        out = {dim: low for dim, (low, _) in self.ranges.items()}
        for own in lengths:
            for dim, size in own.items():
                out[dim] = max(out[dim], size)
        return out

    def pad(self, request: Request, target: Mapping[str, int]) -> Request:
        """``request`` with its padded inputs (tensors or host arrays) extended at the end of each
        padded axis to ``target``."""
        out = dict(request)
        for name, axes in self.axes.items():
            tensor = out[name]
            for axis, dim in axes.items():
                extra = target[dim] - tensor.shape[axis]
                if extra > 0:
                    shape = list(tensor.shape)
                    shape[axis] = extra
                    value = self.values[name]
                    if not isinstance(tensor, torch.Tensor):
                        import numpy  # a host array came in: numpy is loaded already

                        fill_value = value if tensor.dtype.kind in "fc" else int(value)
                        tensor = numpy.concatenate([tensor, numpy.full(shape, fill_value, tensor.dtype)], axis=axis)
                        continue
                    fill = torch.full(shape, value if tensor.is_floating_point() else int(value), dtype=tensor.dtype)
                    tensor = torch.cat([tensor, fill.to(tensor.device)], dim=axis)
            out[name] = tensor
        return out

    def cut(self, outputs: Mapping[str, Any], lengths: Mapping[str, int]) -> dict[str, Any]:
        """Each output (a tensor or a host array) cut back to the request's own lengths on the axes that
        follow them."""
        out = dict(outputs)
        for name, axes in self.cuts.items():
            if name in out:
                for axis, dim in axes.items():
                    out[name] = out[name][(slice(None),) * axis + (slice(0, lengths[dim]),)]
        return out

    def probe(self, call: Callable[[Request], Answer], graph: GraphSpec, batch: int | None) -> Padding:
        """Padding with its output axes found and checked: per padded dim, an example at a short length
        (the tuned min) and the same padded to a longer one (opt, else max) run through ``call``; an
        output axis that grows from the one length to the other is cut back, any other change refuses,
        the cut answer must match the short one's within the dtype's bound (as validation compares with
        eager), and the padded call must run where the short one ran (a pad value outside what was tuned
        would send every padded call eager), else padding is off and :attr:`reason` says what differed."""
        if not self.active:
            return self
        cuts: dict[str, dict[int, str]] = {}
        for dim, (low, high) in self.ranges.items():
            short = max(low, 1)
            rng = graph.dims[dim]
            long = rng.opt if rng.opt > short else high
            if long <= short:
                return attrs.evolve(self, reason=f"the tuned range of {dim} is one length ({short}): nothing to pad")
            base = graph.example("opt", batch_size=batch)
            sizes = {d: max(r.min, 1) if d in self.ranges else r.opt for d, r in graph.dims.items() if d != BATCH}
            sample = resize(graph, base, sizes)
            request = dict(zip([t.path for t in graph.inputs], sample.tensors()))
            target = {d: (long if d == dim else sizes[d]) for d in self.ranges}
            short_answer, long_answer = call(request), call(self.pad(request, target))
            ran_eager = set(long_answer.eager_reasons) - set(short_answer.eager_reasons)
            if ran_eager:
                return attrs.evolve(
                    self,
                    reason=f"a padded call ran eager where the unpadded one did not: {'; '.join(sorted(ran_eager))}",
                )
            got = long_answer.outputs
            for name, a in short_answer.outputs.items():
                b = got.get(name)
                if b is None or a.dim() != b.dim():
                    return attrs.evolve(self, reason=f"output {name} changed its rank when the input was padded")
                for axis in range(1, a.dim()):
                    if a.shape[axis] == b.shape[axis]:
                        continue
                    if (a.shape[axis], b.shape[axis]) != (short, long):
                        return attrs.evolve(
                            self,
                            reason=f"output {name} axis {axis} went from {a.shape[axis]} to {b.shape[axis]} when "
                            f"{dim} went from {short} to {long}: it cannot be cut back to a request's length",
                        )
                    cuts.setdefault(name, {})[axis] = dim
                cut = b
                for axis, d in cuts.get(name, {}).items():
                    if d == dim:
                        cut = cut.narrow(axis, 0, short)
                problem = _differs(cut, a)
                if problem:
                    return attrs.evolve(
                        self,
                        reason=f"padding {dim} from {short} to {long} changed output {name} at the real positions "
                        f"({problem}): the declared pad values do not leave the answers as they were",
                    )
        return attrs.evolve(self, cuts=cuts)


def parse_pad(text: str | Sequence[str] | None) -> dict[str, float]:
    """``aitune serve --pad input_ids=0,attention_mask=0`` (the option may also be repeated) as a padding
    declaration; raises ``ValueError`` saying what to write."""
    items = [text] if isinstance(text, str) else list(text or ())
    out: dict[str, float] = {}
    for part in (p.strip() for item in items for p in item.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not sep or not name.strip() or number is None:
            raise ValueError(
                f"--pad {part!r}: write NAME=VALUE pairs, comma-separated, e.g. --pad input_ids=0,attention_mask=0"
            )
        out[name.strip()] = number
    try:
        return check_pad(out, "--pad")
    except Exception as exc:
        raise ValueError(str(exc)) from None


def _differs(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """How ``actual`` is off ``expected`` beyond the bound validation compares with, or None."""
    if actual.shape != expected.shape:
        return f"shape {list(actual.shape)}, unpadded {list(expected.shape)}"
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if not e.is_floating_point():
        return None if torch.equal(a, e) else "integer values differ"
    tol = DEFAULT_TOLERANCES.get(str(e.dtype).removeprefix("torch."), DEFAULT_TOLERANCES["float32"])
    bound = tol.atol + tol.rtol * float(e.abs().max()) if e.numel() else 0.0
    err = float((a.double() - e.double()).abs().max()) if e.numel() else 0.0
    return None if err <= bound else f"max |padded - unpadded| = {err:.3g}, over the bound {bound:.3g}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


# -- the model the server runs ----------------------------------------------------------------------------


def resolve_factory(factory: Factory | str) -> Factory:
    """A callable, or ``package.module:name`` (the user's own choice, never read from the artifact)."""
    if callable(factory):
        return factory
    module_name, _, attr = str(factory).partition(":")
    if not module_name or not attr:
        raise ValueError(f"factory must be a callable or 'package.module:name', got {factory!r}")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import the model factory {factory!r}: {exc}") from exc
    if not callable(found):
        raise ValueError(f"the model factory {factory!r} is not callable")
    return found


def tuned_threads(artifact: str | Path) -> int | None:
    """The torch threads the artifact was tuned (and timed) with, bounded by this machine's cores."""
    try:
        threads = manifest_of(artifact).environment.get("threads")
    except AituneError:
        return None  # ait.load says what is wrong with the file
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        return None
    return min(threads, os.cpu_count() or 1)


# -- batches of requests ------------------------------------------------------------------------------------


class ClientError(ValueError):
    """What the client must change (a server answers it with a 4xx)."""


@attrs.frozen
class Answer:
    """One request's outputs and how they were computed."""

    outputs: dict[str, Any]
    """Output name -> a torch tensor, or a host numpy array where the request was answered from its
    host arrays (:mod:`aitune.engine.host`)."""
    backends: tuple[str, ...]
    """``module=backend`` for each tuned module that served the request's rows."""
    eager_reasons: tuple[str, ...]
    """Why a tuned module ran eager for these rows (outside what was tuned, ...); empty when none did."""
    batch_sizes: tuple[int, ...]
    """The size of each model call (padding included) that served the request's rows."""
    joined: int
    """How many requests the call that served this one joined (this one included)."""
    padded_to: dict[str, int] = attrs.field(factory=dict)
    """Padded dim -> the length the call ran at (the request's own where it was the longest); empty when
    no padding is known."""


@attrs.frozen
class Call:
    """One model call, for metrics: its size (padding included), its real rows, and each tuned module's route."""

    size: int
    rows: int
    routes: tuple[Route, ...]


class BatchRunner:
    """Runs ``model`` on batches of checked requests, every call inside ``plan``'s tuned sizes
    (synchronous: an engine calls it in a thread of its own). ``on_call`` sees each model call.
    With ``padding`` active, requests of different lengths join one call too (:class:`Padding`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        plan: BatchPlan,
        specs: Mapping[str, InputSpec],
        on_call: Callable[[Call], None] = lambda call: None,
        padding: Padding | None = None,
    ) -> None:
        self.model = model
        self.plan = plan
        self.specs = specs
        self.on_call = on_call
        self.padding = padding or Padding(reason="no padding was given to the runner")
        self._signature = inspect.signature(forward_of(model))  # read once: a wrapped forward's is slow to read
        # every input can be passed by keyword (none is positional-only): the call needs no bind(), which
        # costs tens of microseconds on a forward with many parameters
        self._by_keyword = all(p.kind != p.POSITIONAL_ONLY for p in self._signature.parameters.values())
        self._lanes: dict[tuple[str, ...], HostLane | None] | None = {} if isinstance(model, Module) else None
        """Per set of input names sent, in order: the lane that answers a lone request of host arrays
        (None: none can); None for a model that is no tuned ``ait.Module``."""

    def client_error(self, message: str) -> ClientError:
        """The answer to a request the model cannot take (an engine's own 4xx type, in a subclass)."""
        return ClientError(message)

    def rows(self, request: Request) -> int:
        """The request's batch size (its first input's rows on its batch axis)."""
        name, tensor = next(iter(request.items()))
        return tensor.shape[self.specs[name].batch_axis]

    def run(self, requests: Sequence[Request]) -> list[Answer | ClientError]:
        """One answer per request, in order: its outputs, or what was wrong with it."""
        if len(requests) == 1:  # a lone request (the common case of a lightly loaded server)
            request = requests[0]
            if self._on_arrays(request):
                on_host = self._on_host([request])
                if on_host is not None:
                    return list(on_host)
            request = self._tensors(request)
            with torch.inference_mode():
                if not self.padding.active:
                    rows = self.rows(request)
                    if rows <= self.plan.max_batch_size and self.plan.padded(rows) == rows:
                        return [self._alone(request, rows)]
                return self._run_group([request])
        answers: list[Answer | ClientError | None] = [None] * len(requests)
        groups: dict[Any, list[int]] = collections.defaultdict(list)
        for i, request in enumerate(requests):
            groups[self._shape_key(request)].append(i)
        for members in groups.values():
            group = [requests[i] for i in members]
            done: Sequence[Answer | ClientError] | None = None
            if self._on_arrays(group[0]):
                done = self._on_host(group)
            if done is None:
                with torch.inference_mode():
                    done = self._run_group([self._tensors(r) for r in group])
            for i, answer in zip(members, done):
                answers[i] = answer
        return [a for a in answers if a is not None]

    def _on_arrays(self, request: Request) -> bool:
        """Whether ``request`` holds host arrays that a lane may answer from (the model is a tuned
        ``ait.Module``); its inputs are all of one kind, so its first tells."""
        return self._lanes is not None and not isinstance(next(iter(request.values()), None), torch.Tensor)

    def _tensors(self, request: Request) -> dict[str, torch.Tensor]:
        """The request as torch tensors: a host array made into one (a copy where it is read-only, a
        view of the request's bytes), in the input's dtype where numpy has none (bfloat16)."""
        out = {}
        for name, value in request.items():
            if not isinstance(value, torch.Tensor):
                value = torch.from_numpy(value if value.flags.writeable else value.copy())
                if name in self.specs and self.specs[name].dtype == torch.bfloat16:  # sent as FP32
                    value = value.to(torch.bfloat16)
            out[name] = value
        return out

    def _on_host(self, requests: list[Request]) -> list[Answer] | None:
        """Requests of host arrays that may share calls, answered from the arrays (padded, joined, cut
        into calls of tuned sizes and split back as the tensor path does, each call through the lane of
        :mod:`aitune.engine.host`); None where a lane declines a call: then they all take the tensor
        path, and no call made here is counted."""
        padding = self.padding
        lengths = [padding.lengths(r) for r in requests] if padding.active else []
        known = [own for own in lengths if own is not None]
        target = padding.target(known) if known and len(known) == len(requests) else None
        try:
            if target is None:  # no padding known, or they run as sent
                answers, calls = self._joined(requests, self._call_host)
            else:
                answers, calls = self._joined([padding.pad(r, target) for r in requests], self._call_host)
                answers = [
                    attrs.evolve(a, outputs=padding.cut(a.outputs, own), padded_to=target)
                    for a, own in zip(answers, known)
                ]
        except _Declined:
            return None
        for call in calls:
            self.on_call(call)
        return answers

    def _call_host(self, part: Request, size: int, rows: int) -> tuple[dict[str, Any], Call]:
        """One call of host arrays through its lane (raises :class:`_Declined` where there is none,
        or it declines)."""
        assert self._lanes is not None
        names = tuple(part)
        lane = self._lanes.get(names, _NO_LANE)
        if lane is _NO_LANE:
            if len(self._lanes) >= MAX_LANES:
                self._lanes.clear()
            lane = self._lanes[names] = host_lane(self.model, self._tensors(part), named_outputs)
        answered = lane(part) if lane is not None else None
        if answered is None:
            raise _Declined
        outputs, route = answered
        for array in outputs.values():
            if not array.shape or array.shape[0] != size:
                raise _Declined  # the tensor path says what is wrong with it
        return outputs, Call(size, rows, (route,))

    def _shape_key(self, request: Request) -> Any:
        """Everything but the batch size (and the padded lengths, with padding): requests with one key
        can share a call."""
        padded = self.padding.axes if self.padding.active and self.padding.lengths(request) is not None else {}
        key = []
        for name in sorted(request):
            t, axis = request[name], self.specs[name].batch_axis
            free = set(padded.get(name, ())) | {axis}
            key.append((name, t.dtype, tuple(-1 if a in free else n for a, n in enumerate(t.shape))))
        return tuple(key)

    def _run_group(self, requests: list[Request]) -> list[Answer | ClientError]:
        padding = self.padding
        lengths = [padding.lengths(r) for r in requests] if padding.active else []
        if not lengths or any(own is None for own in lengths):
            return self._run_joined(requests)
        known = [own for own in lengths if own is not None]
        target = padding.target(known)
        answers = self._run_joined([padding.pad(r, target) for r in requests])
        return [
            attrs.evolve(a, outputs=padding.cut(a.outputs, own), padded_to=target) if isinstance(a, Answer) else a
            for a, own in zip(answers, known)
        ]

    def _run_joined(self, requests: list[Request]) -> list[Answer | ClientError]:
        try:
            answers, calls = self._joined(requests, self._call)
        except _ModelRefused as refused:
            if len(requests) == 1:
                if not refused.outside:  # it fits what was tuned: the server's failure, not the request's
                    raise refused.error from None
                return [self.client_error(refused.message())]
        else:
            for call in calls:
                self.on_call(call)
            return list(answers)
        # one request the model cannot take must not fail the others: each one alone
        return [answer for request in requests for answer in self._run_joined([request])]

    def _alone(self, request: Request, rows: int) -> Answer | ClientError:
        """A lone request whose rows are a tuned batch size as sent: one call, with nothing to join, cut,
        pad or merge (what :meth:`_run_joined` does for it, without the steps that do nothing here)."""
        try:
            outputs, call = self._call(request, rows, rows)
        except _ModelRefused as refused:
            if not refused.outside:
                raise refused.error from None
            return self.client_error(refused.message())
        self.on_call(call)
        return _answer(outputs, [call], 1)

    def _joined(self, requests: list[Request], call: _Caller) -> tuple[list[Answer], list[Call]]:
        """The requests joined, cut into calls of tuned sizes made by ``call`` (the last padded by
        repeating its last row), and each one's answer cut back out; tensors or host arrays alike.
        The calls are counted by the caller, once their answers are used."""
        counts = [self.rows(r) for r in requests]
        names = list(requests[0])
        if len(requests) == 1:
            joined = requests[0]
        else:
            joined = {n: _cat([r[n] for r in requests], self.specs[n].batch_axis) for n in names}
        pieces: list[dict[str, Any]] = []
        spans: list[tuple[int, int, Call]] = []  # (first row, end row, call) per model call
        start = 0
        for take, size in self.plan.chunks(sum(counts)):
            part = {n: _rows(t, self.specs[n].batch_axis, start, take, size) for n, t in joined.items()}
            outputs, made = call(part, size, take)
            pieces.append(outputs if take == size else {n: o[:take] for n, o in outputs.items()})
            spans.append((start, start + take, made))
            start += take
        merged = pieces[0] if len(pieces) == 1 else {n: _cat([p[n] for p in pieces], 0) for n in pieces[0]}
        answers = []
        first = 0
        for count in counts:
            calls = [c for lo, hi, c in spans if lo < first + count and first < hi]
            outputs = merged if len(counts) == 1 else {n: o[first : first + count] for n, o in merged.items()}
            answers.append(_answer(outputs, calls, len(requests)))
            first += count
        return answers, [c for _, _, c in spans]

    def _call(self, part: Request, size: int, rows: int) -> tuple[dict[str, torch.Tensor], Call]:
        with observe_routes() as seen:
            try:
                if self._by_keyword:
                    outputs = named_outputs(self.model(**part))
                else:
                    bound = self._signature.bind(**part)
                    outputs = named_outputs(self.model(*bound.args, **bound.kwargs))
            except Exception as exc:
                raise _ModelRefused(exc, seen) from exc
        for name, tensor in outputs.items():
            shape = tensor.shape  # one torch call per output: each is microseconds in a busy server
            if not shape or shape[0] != size:
                raise RuntimeError(
                    f"output {name!r} has shape {tuple(tensor.shape)}: aitune serve splits a batched call's "
                    f"outputs on axis 0, which must hold the call's {size} rows"
                )
        return outputs, Call(size, rows, tuple(seen))


def _answer(outputs: dict[str, Any], calls: Sequence[Call], joined: int) -> Answer:
    """A request's answer from its outputs and the model calls that served its rows."""
    return Answer(
        outputs,
        tuple(dict.fromkeys(f"{r.module}={r.backend}" for c in calls for r in c.routes)),
        tuple(dict.fromkeys(f"{r.module}: {r.reason}" for c in calls for r in c.routes if r.reason)),
        tuple(c.size for c in calls),
        joined,
    )


def _rows(tensor: Any, axis: int, start: int, take: int, size: int) -> Any:
    """Rows ``start .. start+take`` on ``axis`` of a tensor or a host array, padded to ``size`` rows by
    repeating the last one."""
    if size == take and start == 0 and tensor.shape[axis] == take:
        return tensor
    if isinstance(tensor, torch.Tensor):
        index = torch.arange(start, start + size).clamp(max=start + take - 1)
        return tensor.index_select(axis, index)
    return tensor.take([min(i, start + take - 1) for i in range(start, start + size)], axis=axis)


def _cat(parts: list[Any], axis: int) -> Any:
    """Tensors or host arrays joined on ``axis``."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=axis)
    import numpy  # a host array came in: numpy is loaded already

    return numpy.concatenate(parts, axis=axis)


_Caller = Callable[[Request, int, int], tuple[dict[str, Any], Call]]
"""One model call of a part of joined requests, its size and its real rows: its outputs and the call."""


class _Declined(Exception):
    """A lane declined a call of host arrays: the requests take the tensor path instead."""


_NO_LANE: Any = object()
MAX_LANES = 64
"""Sets of input names (in the order sent) a runner keeps a lane for."""


class _ModelRefused(Exception):
    """The model raised on a call; a client error when a tuned module had sent it eager (its input
    was outside what was tuned, and eager could not take it either), else the server's own."""

    def __init__(self, error: Exception, routes: Sequence[Route]) -> None:
        super().__init__(str(error))
        self.error = error
        self.outside = [f"{r.module}: {r.reason}" for r in routes if r.reason]

    def message(self) -> str:
        first_line = str(self.error).strip().splitlines()[0] if str(self.error).strip() else ""
        return (
            f"the model cannot take this input: {'; '.join(self.outside)}, and the model itself raised "
            f"{type(self.error).__name__}: {first_line}"
        )
