"""The per-call path of a tuned module: a dict lookup from the call's structure to its winner.

No signature binding for calls made the way the graph's recorded calls were, no copies: the structure key is built
in one pass that also collects the tensors, then each candidate graph's precomputed shape checks
run on them. Anything outside what was tuned runs eager for that call, with one warning (or, in
strict mode, raises): another structure or shape, and integer values a tuned backend may take where
eager raises (:class:`ValueCheck`: a token id below 0 or past its embedding's rows); so does a call
whose tuned backend raises, and one the :class:`Guard` stops (training mode, autograd, weights
changed since tuning).

Thread safety: a dispatcher only adds entries to its lookup table and its set of warnings given
(single dict and set operations, atomic in CPython), so one tuned module may be called from many
threads at once; each backend's ``infer`` must be, too (see docs/serving.md).

A server that must say which backend answered (per batch, in a response header and its metrics)
wraps its calls in :func:`observe_routes`: outside it, the per-call cost is one context lookup.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch

from .. import tree
from ..errors import UnsupportedCallError, UnsupportedValueError
from ..graph import GraphSpec, outside
from .guard import Guard
from .recording import Canonicalizer, Layout, layout_of

logger = logging.getLogger("aitune")

Runner = Callable[..., Any]
_call_key = tree.call_key  # bound once: read on every call
_shape = operator.attrgetter("shape")
_NO_KWARGS = tree.call_key({}, [])
"""The key of an empty kwargs dict, built once: most calls pass none."""
_NO_ARGS = tree.call_key((), [])
"""The key of no positional arguments, built once: a call by keyword (as BERT's) passes none."""
_Fit = tuple["ValueCheck | None", Runner]
"""A graph a call's shapes fit: its value check (None: none needed) and its runner."""
_Entry = tuple["Layout | None", list[tuple["ShapeCheck", Runner]], bool, dict[tuple[torch.Size, ...], "_Fit | None"]]
"""Per call key: the layout to rearrange calls to (None: as made), the candidate graphs, whether
the call can be described to a backend at all, and the graph each set of input shapes seen so
far fits (None: none fits), so a shape is checked against the graphs' ranges once."""
MAX_SHAPES = 1024
"""Input shapes remembered per call key (a server sees one per batch size and sequence length)."""
_NOT_SEEN: Any = object()


class Route(NamedTuple):
    """How one call of one tuned module was answered."""

    module: str
    """The tuned module's name (``ait.Module(..., name)``)."""
    backend: str
    """The backend that answered: the graph's winner, or ``torch_eager``."""
    reason: str | None = None
    """Why the call ran eager although the module is tuned (outside what was tuned, a backend that
    raised, grad mode...); None when it ran as tuned (eager included, where eager won)."""


_observed: ContextVar[list[Route] | None] = ContextVar("aitune_observed_routes", default=None)


class observe_routes:  # lower case: used as a function, ``with observe_routes() as seen``
    """Collect a :class:`Route` for every call of a tuned module made inside (this thread or task
    only; ``asyncio.to_thread`` copies the context, so a thread started inside adds to the list).
    A class, not a generator-based context manager: a server enters it on every model call."""

    __slots__ = ("_seen", "_token")

    def __enter__(self) -> list[Route]:
        self._seen: list[Route] = []
        self._token = _observed.set(self._seen)
        return self._seen

    def __exit__(self, *exc: object) -> None:
        _observed.reset(self._token)


EAGER = "torch_eager"


def _note(module: str, runner: Runner | None, reason: str | None = None) -> None:
    """Record the route of a call being observed; ``runner`` None for eager, else a backend's ``infer``."""
    seen = _observed.get()
    if seen is not None:
        backend = getattr(getattr(runner, "__self__", runner), "name", None) if runner is not None else EAGER
        seen.append(Route(module, backend if isinstance(backend, str) else type(runner).__name__, reason))


class ShapeCheck:
    """A graph's shape ranges as flat tuples, checked without building messages.

    ``bounds`` holds the axes to check as ``(leaf, axis, lo, hi)`` (a static axis has ``lo == hi``);
    ``ties`` pairs a place where a named dimension appears again with its first place, which must
    hold the same size. A leaf whose axes are all those of an earlier leaf (a mask and token types
    beside the token ids) is checked as one comparison of whole shapes (``same``). ``values``: the
    graph's :class:`ValueCheck`, run once the shapes fit.
    """

    def __init__(self, graph: GraphSpec) -> None:
        self.graph = graph
        self.n = len(graph.inputs)
        bounds, ties, same = [], [], []
        first: dict[str, tuple[int, int]] = {}
        forms: dict[tuple[Any, ...], int] = {}
        for i, spec in enumerate(graph.inputs):
            form = tuple(name if name is not None else size for size, name in zip(spec.shape, spec.dims))
            if form in forms:
                same.append((forms[form], i))
                continue
            forms[form] = i
            for axis, (size, name) in enumerate(zip(spec.shape, spec.dims)):
                if name is None:
                    bounds.append((i, axis, size, size))
                    continue
                bounds.append((i, axis, graph.dims[name].min, graph.dims[name].max))
                if name in first:
                    ties.append((*first[name], i, axis))
                else:
                    first[name] = (i, axis)
        self.bounds = tuple(bounds)
        self.ties = tuple(ties)
        self.same = tuple(same)
        self.values = ValueCheck.of(graph)

    def fits(self, leaves: Sequence[torch.Tensor]) -> bool:
        if len(leaves) != self.n:
            return False
        shapes = [t.shape for t in leaves]  # reading .shape builds a torch.Size: once per leaf
        for i, axis, lo, hi in self.bounds:
            if not lo <= shapes[i][axis] <= hi:
                return False
        for i, a, j, b in self.ties:
            if shapes[i][a] != shapes[j][b]:
                return False
        for i, j in self.same:  # noqa: SIM110 (a loop: all() over a generator costs more on this per-call path)
            if shapes[i] != shapes[j]:
                return False
        return True


_SIGNED = frozenset({"int8", "int16", "int32", "int64"})
_UNSIGNED = frozenset({"uint8", "uint16", "uint32", "uint64"})


class ValueCheck:
    """The integer inputs of a graph whose values a tuned backend may take where eager raises (a
    negative id that a gather wraps), each with the range it accepts (:attr:`ValueFacts.accepted
    <aitune.graph.ValueFacts.accepted>`): one min (or min and max) per such input and call, read back
    to Python (on a GPU, one synchronisation each); a graph without them has none (:meth:`of` gives None)."""

    def __init__(self, checks: Sequence[tuple[int, int, int | None, str]]) -> None:
        self.checks = tuple(checks)
        """Per checked input: its leaf, the lowest and highest value accepted (None: no upper end), and
        what to say when a call's value lies outside (naming the input and its ranges, no value of
        the call's: a warning given once per reason is given once per input)."""

    @classmethod
    def of(cls, graph: GraphSpec) -> ValueCheck | None:
        checks = []
        for i, spec in enumerate(graph.inputs):
            facts = spec.values
            accepted = facts.accepted if facts is not None else None
            if facts is None or accepted is None or spec.dtype not in _SIGNED | _UNSIGNED:
                continue
            low, high = accepted
            seen = f"tuning saw {facts.low}..{facts.high}"
            if high is not None:
                why = f"{spec.path} holds a value outside {low}..{high}, the rows of the embedding it indexes ({seen})"
            elif spec.dtype in _SIGNED:
                why = (
                    f"{spec.path} holds a value below {low} ({seen}): a tuned backend may take a negative id "
                    "where eager raises"
                )
            else:  # unsigned, no table known: nothing it holds can be out of range
                continue
            checks.append((i, low, high, why))
        return cls(checks) if checks else None

    def outside(self, leaves: Sequence[torch.Tensor]) -> str | None:
        """Why these inputs hold a value outside an accepted range, or None when none does."""
        for i, low, high, why in self.checks:
            t = leaves[i]
            n = t.numel()
            if not n:
                continue
            if n <= SMALL_CHECK and t.is_cpu:  # a sentence's ids: Python's min and max on a list beat two ops
                values = t.reshape(-1).tolist()
                if min(values) < low or (high is not None and max(values) > high):
                    return why
                continue
            if high is None:
                if t.min().item() < low:
                    return why
                continue
            lo, hi = torch.aminmax(t)
            if lo.item() < low or hi.item() > high:
                return why
        return None

    def outside_arrays(self, arrays: Sequence[Any]) -> bool:
        """Whether host numpy ``arrays`` (the graph's inputs) hold a value outside an accepted range:
        the caller then takes the tensor path, where :meth:`outside` says why."""
        for i, low, high, _ in self.checks:
            a = arrays[i]
            if not a.size:
                continue
            if a.size <= SMALL_CHECK:  # Python's min and max on a list: one numpy call instead of two
                values = a.ravel().tolist()
                if min(values) < low or (high is not None and max(values) > high):
                    return True
            elif a.min() < low or (high is not None and a.max() > high):
                return True
        return False


SMALL_CHECK = 256
"""Up to this many values, a host input's range is checked on a Python list: one op instead of three,
about 20 µs less per call of a served model (where each torch op finds its caches cold)."""


class Dispatcher:
    """Routes each call of a tuned module to the runner of the graph it fits, else to eager.

    Runners get the call the way the graph's recorded calls were made (see
    :meth:`Canonicalizer.arrange`); a call made another way is rearranged to that form, and eager
    fallbacks get the call exactly as made.
    """

    MAX_KEYS = 4096
    """Call keys remembered; objects passed by identity (a cache per request) would grow it forever."""

    def __init__(
        self,
        name: str,
        eager: Runner,
        canonicalize: Canonicalizer,
        routes: Sequence[tuple[GraphSpec, Runner]],
        strict: bool = False,
        *,
        guard: Guard,
    ) -> None:
        self.name = name
        self.guard = guard
        self.eager = eager
        self.canonicalize = canonicalize
        self.strict = strict
        self.routes = [(ShapeCheck(graph), runner) for graph, runner in routes]
        self._table: dict[Any, _Entry] = {}
        self._warned: set[str] = set()

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves: list[torch.Tensor] = []
        key = (_call_key(args, leaves) if args else _NO_ARGS, _call_key(kwargs, leaves) if kwargs else _NO_KWARGS)
        blocked = self.guard.blocked(leaves)
        if blocked is not None:
            return self._blocked(blocked, args, kwargs)
        entry = self._table.get(key)
        if entry is None:
            entry = self._resolve(key, args, kwargs)
        layout, candidates, describable, fitted = entry
        if not describable:  # a value no backend can take (a cache object, a callable): eager by design
            _note(self.name, None, "its inputs hold a value no backend can take")
            return self.eager(*args, **kwargs)
        c_args, c_kwargs = args, kwargs
        if layout is not None:
            try:
                c_args, c_kwargs = self.canonicalize.arrange(args, kwargs, layout)
            except TypeError:  # the same key, yet not the same call in the graph's form: eager decides
                return self._fallback([], leaves, args, kwargs)
            leaves = []
            tree.call_key((c_args, c_kwargs), leaves)
        shapes = tuple(map(_shape, leaves))  # map and attrgetter run in C: no frame per leaf
        fit = fitted.get(shapes, _NOT_SEEN)  # one lookup: another thread may clear the dict between two
        if fit is _NOT_SEEN:
            fit = self._fit(candidates, leaves, fitted, shapes)
        if fit is None:
            return self._fallback(candidates, leaves, args, kwargs)
        values, runner = fit
        if runner is self.eager:  # a range or graph where eager won: nothing to fall back from
            if _observed.get() is not None:
                _note(self.name, None)
            return runner(*args, **kwargs)
        if values is not None:
            why = values.outside(leaves)
            if why is not None:
                return self._outside(why, "pass values in that range", args, kwargs)
        try:
            out = runner(*c_args, **c_kwargs)
        except Exception as exc:
            if self.strict:
                raise
            logger.debug("%s: tuned backend failed", self.name, exc_info=True)
            return self._eager_because(
                f"the tuned backend raised {type(exc).__name__}: {exc}; tune again or load with "
                "another backend if this persists",
                args,
                kwargs,
            )
        if _observed.get() is not None:
            _note(self.name, runner)
        return out

    def keyword_routes(self, example: dict[str, torch.Tensor]) -> list[tuple[ShapeCheck, Runner]]:
        """The routes a call by keyword of ``example``'s structure (its names in order, dtypes, ranks
        and devices) may fit, in the order this dispatcher tries them (:mod:`aitune.engine.host`
        reads this); empty when no tuned graph takes such a call."""
        leaves: list[torch.Tensor] = []
        key = (_NO_ARGS, _call_key(example, leaves))
        entry = self._table.get(key)
        if entry is None:
            entry = self._resolve(key, (), example)
        _, candidates, describable, _ = entry
        return list(candidates) if describable else []

    @staticmethod
    def _fit(
        candidates: list[tuple[ShapeCheck, Runner]],
        leaves: list[torch.Tensor],
        fitted: dict[tuple[torch.Size, ...], _Fit | None],
        shapes: tuple[torch.Size, ...],
    ) -> _Fit | None:
        """The value check and runner of the first graph whose shape ranges these inputs fit (None:
        none), remembered for their shapes: the ranges depend on nothing else."""
        fit = next(((check.values, r) for check, r in candidates if check.fits(leaves)), None)
        if len(fitted) >= MAX_SHAPES:
            fitted.clear()
        fitted[shapes] = fit
        return fit

    def _blocked(self, blocked: tuple[str, type[Exception]], args: Any, kwargs: Any) -> Any:
        reason, error = blocked
        if self.strict:
            raise error(f"{self.name}: this call cannot run tuned: {reason}")
        return self._eager_because(reason, args, kwargs)

    @contextlib.contextmanager
    def warnings_kept(self) -> Iterator[None]:
        """Calls made inside (aitune timing the whole model) leave each once-per-reason warning
        for the user's own first call."""
        before = set(self._warned)
        try:
            yield
        finally:
            self._warned = before

    def _eager_because(self, reason: str, args: Any, kwargs: Any) -> Any:
        """Run this call eager, warning once per reason."""
        _note(self.name, None, reason)
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"{self.name}: running this call eager: {reason}", RuntimeWarning, stacklevel=4)
        return self.eager(*args, **kwargs)

    def _resolve(self, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Entry:
        """The graphs a call of this key may fit, and the form (layout) to call them in."""
        entry: _Entry = (None, [], True, {})
        try:
            tree.flatten((args, kwargs))
        except UnsupportedValueError:
            entry = (None, [], False, {})
        except Exception:  # not describable for another reason: eager handles it, with the usual warning
            pass
        else:
            for check, _ in self.routes:
                layout = _layout(check.graph)
                try:
                    c_args, c_kwargs = self.canonicalize.arrange(args, kwargs, layout)
                    leaves, structure = tree.flatten((c_args, c_kwargs))
                except Exception:  # not a call this graph's form can take
                    continue
                if _same_structure(check.graph, structure, leaves):
                    matching = [(c, r) for c, r in self.routes if _layout(c.graph) == layout]
                    matching = [(c, r) for c, r in matching if _same_structure(c.graph, structure, leaves)]
                    same = layout == layout_of(args, kwargs)
                    entry = (None if same else layout, matching, True, {})
                    break
        if len(self._table) >= self.MAX_KEYS:
            self._table.clear()
        self._table[key] = entry
        return entry

    def _fallback(
        self, candidates: list[tuple[ShapeCheck, Runner]], leaves: list[torch.Tensor], args: Any, kwargs: Any
    ) -> Any:
        if candidates:  # only what the routes holding the call's sizes lack (graph.outside)
            reason = outside([c.graph for c, _ in candidates], leaves)
        else:
            reason = self._unseen(args, kwargs)
        return self._outside(reason, "tune with inputs like this one", args, kwargs)

    def _outside(self, reason: str, fix: str, args: Any, kwargs: Any) -> Any:
        """A call outside what was tuned: eager, warned once per reason, or in strict mode an error."""
        if self.strict:
            raise UnsupportedCallError(
                f"{self.name}: this call is outside what was tuned ({reason}); {fix}, or drop strict=True"
            )
        return self._eager_because(f"it is outside what was tuned ({reason})", args, kwargs)

    def _unseen(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """What this call has that no tuned call had, against the tuned graph it is closest to, and
        what to record to cover it. Runs once per call key (the warning is given once)."""
        closest: list[str] | None = None
        for check, _ in self.routes:
            try:
                found = _differences(check.graph, self.canonicalize, args, kwargs)
            except Exception:  # describing the call must never stop it from running eager
                logger.debug("%s: could not compare a call with a tuned graph", self.name, exc_info=True)
                continue
            if found and (closest is None or len(found) < len(closest)):
                closest = found
        if not closest:
            return "its input structure (types, dtypes, ranks or devices) was never seen while tuning"
        shown = "; ".join(closest[:3]) + (f"; and {len(closest) - 3} more" if len(closest) > 3 else "")
        return f"{shown}; to cover it, record calls like this one in ait.tune's dataset"


def _differences(
    graph: GraphSpec, canonicalize: Canonicalizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[str]:
    """What this call has that the calls of ``graph`` did not (see :meth:`GraphSpec.differences`)."""
    n_args, names = _layout(graph)
    try:
        c_args, c_kwargs = canonicalize.arrange(args, kwargs, (n_args, names))
    except TypeError as exc:  # another set of keywords, or one off its default that tuned calls left out
        found = [
            f"the keyword {k}={_short(v)} was never passed while tuning" for k, v in kwargs.items() if k not in names
        ]
        return found or [f"{exc} (tuned calls passed {', '.join(names) or 'no arguments'} by keyword)"]
    try:
        leaves, structure = tree.flatten((c_args, c_kwargs))
    except Exception as exc:
        return [str(exc)]
    return graph.differences(structure, leaves)


def _short(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"<{str(value.dtype).removeprefix('torch.')} tensor {tuple(value.shape)}>"
    return f"<{type(value).__name__}>"


def _layout(graph: GraphSpec) -> Layout:
    """How the calls of ``graph`` were made: its structure's positional count and keywords."""
    args_node, kwargs_node = graph.structure["items"]
    return len(args_node["items"]), tuple(kwargs_node["keys"])


def _same_structure(graph: GraphSpec, structure: dict[str, Any], leaves: Sequence[torch.Tensor]) -> bool:
    if structure != graph.structure or len(leaves) != len(graph.inputs):
        return False
    return all(
        str(t.dtype).removeprefix("torch.") == spec.dtype and t.dim() == spec.rank and t.device.type == spec.device
        for t, spec in zip(leaves, graph.inputs)
    )
