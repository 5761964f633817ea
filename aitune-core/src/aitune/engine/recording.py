"""Recording real calls of wrapped modules while ``ait.tune`` runs the user's pipeline.

Calls are grouped by graph (input structure, in canonical form: positional and keyword calls of
the same parameters land together). Each graph keeps a few samples of distinct shapes, detached
copies so later in-place changes by the pipeline cannot alter them, plus the eager outputs, and
what values every call's inputs took (:class:`~aitune.graph.ValueFacts`), kept samples or not.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import attrs
import torch

from .. import tree
from ..errors import InputError, UnsupportedValueError
from ..graph import Sample, ValueFacts, merge_facts


class _ThreadState(threading.local):
    """Per thread: the recording in progress and how deep aitune's own calls are nested. Class-level
    defaults make each read a plain attribute read (every tuned call asks :func:`bypassing`)."""

    recording: Recording[Any] | None = None
    bypass = 0


_state = _ThreadState()


def active_recording() -> Recording[Any] | None:
    return _state.recording


def bypassing() -> bool:
    """True while aitune itself runs modules (building, validating): wrappers call through."""
    return _state.bypass > 0


@contextlib.contextmanager
def bypass() -> Iterator[None]:
    _state.bypass += 1
    try:
        yield
    finally:
        _state.bypass -= 1


@contextlib.contextmanager
def recording(max_samples: int) -> Iterator[Recording[Any]]:
    previous = active_recording()
    current: Recording[Any] = Recording(max_samples)
    _state.recording = current
    try:
        yield current
    finally:
        _state.recording = previous


Layout = tuple[int, tuple[str, ...]]
"""How a call was made: how many arguments went positionally, and the keywords, in order."""


def layout_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Layout:
    return len(args), tuple(kwargs)


class Canonicalizer:
    """Binds calls to the module's signature: one graph key per call, whatever its form.

    The key is taken from the canonical form (positional parameters in args, keyword-only in
    kwargs, defaults filled in), so ``f(x)``, ``f(x, mask=None)`` and ``f(x=x)`` are one graph.
    Backends, eager included, are still called the way the module was called (:meth:`arrange`):
    decorators such as those on transformers' ``forward`` read their keyword arguments and would
    see one argument twice if it were moved to a position.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        try:
            self.signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):
            self.signature = None
        params = list(self.signature.parameters.values()) if self.signature else []
        self.arg_names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.signature is None:
            return args, kwargs
        positional, named = self._values(args, kwargs)
        return tuple(v for _, v in positional), named

    def _values(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[tuple[str | None, Any]], dict[str, Any]]:
        """Every parameter's value, defaults filled in: the positional ones in order (``None`` names
        the extras of ``*args``), then keyword-only ones and the entries of ``**kwargs``."""
        assert self.signature is not None
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        positional: list[tuple[str | None, Any]] = []
        named: dict[str, Any] = {}
        for name, param in self.signature.parameters.items():
            value = bound.arguments[name]
            if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                positional.append((name, value))
            elif param.kind == param.VAR_POSITIONAL:
                positional.extend((None, v) for v in value)
            elif param.kind == param.KEYWORD_ONLY:
                named[name] = value
            else:
                named.update(value)
        return positional, named

    def arrange(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], layout: Layout
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The same call made in ``layout`` (as many positional arguments, these keywords).

        Raises ``TypeError`` when that is impossible without changing the call: a parameter the
        layout leaves out must be at its default, and ``*args`` extras cannot become keywords.
        """
        n_args, names = layout
        if len(args) == n_args and len(kwargs) == len(names):
            if tuple(kwargs) == names:
                return args, kwargs
            if kwargs.keys() == set(names):  # the same keywords in another order (a server's request)
                return args, {n: kwargs[n] for n in names}
        if self.signature is None:
            raise TypeError("the module's signature is unknown, so a call cannot be rearranged")
        positional, named = self._values(args, kwargs)
        if n_args > len(positional):
            raise TypeError(f"the layout passes {n_args} arguments by position, the call has {len(positional)}")
        rest = positional[n_args:]
        if any(name is None for name, _ in rest):
            raise TypeError("extra positional arguments (*args) cannot be passed by keyword")
        values = {**{name: v for name, v in rest if name is not None}, **named}
        missing = [n for n in names if n not in values]
        if missing:
            raise TypeError(f"the layout passes {missing} by keyword, which the call does not have")
        params = self.signature.parameters
        for name, value in values.items():
            if name in names:
                continue
            default = params[name].default if name in params else inspect.Parameter.empty
            if not _is_default(value, default):
                raise TypeError(f"{name}={value!r} is not its default, so it cannot be left out")
        return tuple(v for _, v in positional[:n_args]), {n: values[n] for n in names}


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    if default is inspect.Parameter.empty or type(value) is not type(default):
        return False
    return isinstance(value, (bool, int, float, str)) and value == default


def structure_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The hashable graph key of a canonical call (see :func:`aitune.tree.call_key`)."""
    return tree.call_key((args, kwargs), [])


def _detach(value: Any) -> Any:
    """A copy of ``value`` whose tensors are detached clones, in the same container types."""
    leaves, structure = tree.flatten(value)
    return tree.unflatten(structure, [t.detach().clone() for t in leaves])


def _shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    leaves: list[torch.Tensor] = []
    tree.call_key((args, kwargs), leaves)
    return tuple(tuple(t.shape) for t in leaves)


def _check_finite(args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...]) -> None:
    """NaN inputs make every comparison with eager meaningless: refuse them, naming the input."""
    for i, value in [*enumerate(args), *kwargs.items()]:
        path = names[i] if isinstance(i, int) and i < len(names) else str(i)
        leaves, _ = tree.flatten(value, path)
        for leaf in leaves:
            if (leaf.is_floating_point() or leaf.is_complex()) and bool(torch.isnan(leaf).any()):
                raise InputError(
                    f"input {path!r} holds NaN values; validation compares every candidate with eager and "
                    "cannot judge NaN: give ait.tune finite inputs (clean or drop those batches)"
                )


def _check_output(output: Any) -> None:
    try:
        tree.flatten(output, "output")
    except UnsupportedValueError as exc:
        raise UnsupportedValueError(
            f"{exc}. Return tensors in tuples, lists, dicts, NamedTuples or dataclasses "
            "(with transformers, pass use_cache=False so no cache object is returned), "
            "or wrap the submodule that returns tensors instead"
        ) from exc


def _check_describable(args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...]) -> None:
    """Raise :class:`UnsupportedValueError` for an input aitune cannot describe, naming its parameter."""
    for i, value in enumerate(args):
        tree.flatten(value, names[i] if i < len(names) else f"args.{i}")
    for name, value in kwargs.items():
        tree.flatten(value, name)


def _unsupported(args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...]) -> str:
    """Why these inputs cannot be described, naming the parameter."""
    try:
        _check_describable(args, kwargs, names)
    except UnsupportedValueError as exc:
        return str(exc)
    return "the inputs cannot be described"


def _holds_state(node: dict[str, Any]) -> bool:
    """The structure holds a state object (a KV cache), whose tensors a call updates in place."""
    return node.get("kind") == "state" or any(_holds_state(n) for n in node.get("items", ()))


def holds_state(sample: Sample) -> bool:
    """The recorded call passed a state object (a static KV cache)."""
    try:
        return _holds_state(tree.flatten((sample.args, sample.kwargs))[1])
    except UnsupportedValueError:
        return False


def _changed(before: Before | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    """The ids of the input tensors this call updated in place (compared with the copy taken
    before it, else by version counter)."""
    if before is None:
        return set()
    try:
        after = tree.flatten((args, kwargs))[0]
    except Exception:
        return set()
    if before.snapshot is not None:
        pre = tree.flatten(before.snapshot)[0]
        return {id(a) for a, b in zip(after, pre) if a.shape != b.shape or not torch.equal(a, b)}
    now = _versions(after)
    if now is None or before.versions is None:
        return set()
    return {id(a) for a, v0, v1 in zip(after, before.versions, now) if v0 != v1}


@attrs.define
class GraphRecording:
    """The samples and eager outputs recorded for one graph of one module."""

    layout: Layout = (0, ())
    """How its calls are made (the first call's form): every backend is called this way."""
    samples: list[Sample] = attrs.field(factory=list)
    outputs: list[Any] = attrs.field(factory=list)
    shapes: list[tuple[tuple[int, ...], ...]] = attrs.field(factory=list)
    calls: int = 0
    error: str | None = None
    eager_reason: str | None = None
    """Why this graph runs eager without tuning (a value no backend can take), or None."""
    mutated: set[int] = attrs.field(factory=set)
    """Indices of the input leaves eager updated in place (a static KV cache), in the graph's order."""
    values: list[ValueFacts | None] = attrs.field(factory=list)
    """Per input leaf, what values every recorded call took (before the call, for one that updates
    its inputs in place), for the graph spec: a few samples are kept, every call is counted here."""


class Recordable(Protocol):
    """What recording needs of a wrapper (``ait.Module``, the JIT's): how to read its calls.

    A protocol, so this module never imports the wrappers that use it.
    """

    @property
    def canonicalizer(self) -> Canonicalizer: ...


W = TypeVar("W", bound=Recordable)


@attrs.define
class ModuleRecording(Generic[W]):
    module: W
    graphs: dict[Any, GraphRecording] = attrs.field(factory=dict)
    calls: int = 0
    mutates: bool = False
    """A call updated an input in place: later calls are copied before they run."""


@attrs.frozen
class Before:
    """What a call's inputs were before it ran: version counters and, where needed, a copy."""

    versions: tuple[int, ...] | None
    snapshot: tuple[tuple[Any, ...], dict[str, Any]] | None
    unsupported: str | None = None
    """Why the inputs as they were could not be described (a cache the call fills), or None."""


def _versions(leaves: list[torch.Tensor]) -> tuple[int, ...] | None:
    try:
        return tuple(t._version for t in leaves)
    except RuntimeError:  # inference tensors keep no version counter
        return None


class Recording(Generic[W]):
    """Everything wrapped modules saw during one ``ait.tune`` run, in first-call order."""

    def __init__(self, max_samples: int) -> None:
        self.max_samples = max_samples
        self.modules: dict[int, ModuleRecording[W]] = {}
        self.items: list[Any] = []
        """The first dataset items, kept for the end-to-end figure."""
        self._making_up = False
        self._made_up: set[tuple[int, Any]] = set()
        """(module, graph key) of the graphs a made-up call opened (:meth:`made_up`)."""

    @contextlib.contextmanager
    def made_up(self) -> Iterator[None]:
        """Calls made by aitune rather than taken from the dataset (an item with its mask unpadded): they
        record only into graphs that such calls opened, so the dataset's own graphs keep the dataset's
        samples and counts, and a call aitune could not describe adds no graph."""
        self._making_up = True
        try:
            yield
        finally:
            self._making_up = False

    def before_call(self, module: W, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Before | None:
        """Note the inputs before ``module`` runs, so :meth:`record` can tell what the call updated
        in place and keep the inputs as they were. Inputs are copied only when that may matter:
        a module's first call, a module seen updating inputs, or a call passing a state object
        (a KV cache), and only while its graph would keep the sample."""
        try:
            leaves, structure = tree.flatten((args, kwargs))
        except UnsupportedValueError:
            return Before(None, None, _unsupported(args, kwargs, module.canonicalizer.arg_names))
        except Exception:
            return None
        rec = self.modules.get(id(module))
        risky = rec is None or rec.mutates or _holds_state(structure)
        wanted = risky and self._wants_sample(rec, module, args, kwargs)
        return Before(_versions(leaves), _detach((args, kwargs)) if wanted else None)

    def _wants_sample(
        self, rec: ModuleRecording[W] | None, module: W, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> bool:
        if rec is None:
            return True
        try:
            graph = rec.graphs.get(structure_key(*module.canonicalizer(args, kwargs)))
        except Exception:
            return True
        return graph is None or len(graph.samples) < self.max_samples or _shapes(args, kwargs) not in graph.shapes

    def record(
        self, module: W, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, before: Before | None = None
    ) -> None:
        if self._making_up and not self._opens(module, args, kwargs):
            return
        rec = self.modules.setdefault(id(module), ModuleRecording(module))
        rec.calls += 1
        canonicalize = module.canonicalizer
        names = canonicalize.arg_names
        layout = layout_of(args, kwargs)
        changed = _changed(before, args, kwargs)
        if changed:
            rec.mutates = True
        pre = before.snapshot if before is not None else None
        try:
            key: Any = structure_key(*canonicalize(args, kwargs))
            graph = rec.graphs.get(key)
            if graph is not None and graph.layout != layout:
                try:  # one graph, called another way: store it the way the graph's first call was made
                    args, kwargs = canonicalize.arrange(args, kwargs, graph.layout)
                    if pre is not None:
                        pre = canonicalize.arrange(*pre, graph.layout)
                except TypeError:
                    key = (key, layout)
                    graph = rec.graphs.get(key)
            try:  # refuses inputs aitune cannot describe, naming the path
                if before is not None and before.unsupported:  # as they were before the call
                    raise UnsupportedValueError(before.unsupported)
                _check_describable(args, kwargs, names)
                _check_output(output)
            except UnsupportedValueError as exc:
                eager = rec.graphs.setdefault(("eager", str(exc)), GraphRecording(layout))
                eager.calls += 1
                eager.eager_reason = str(exc)
                return
            _check_finite(args, kwargs, names)
            if graph is None:
                graph = rec.graphs.setdefault(key, GraphRecording(layout))
            graph.calls += 1
        except Exception as exc:
            graph = rec.graphs.setdefault(("unsupported", type(exc).__name__, str(exc)), GraphRecording(layout))
            graph.calls += 1
            graph.error = f"{type(exc).__name__}: {exc}"
            return
        if before is None and _holds_state(tree.flatten((args, kwargs))[1]):
            return  # no copy from before the call: the state it holds may have changed since
        if changed:
            after = tree.flatten((args, kwargs))[0]
            graph.mutated.update(i for i, t in enumerate(after) if id(t) in changed)
            if pre is None:  # updated in place and not copied before: the inputs as they were are gone
                return
        graph.values = merge_facts(graph.values, tree.flatten(pre if pre is not None else (args, kwargs))[0])
        shapes = _shapes(args, kwargs)
        sample = Sample(*pre) if pre is not None else Sample(_detach(args), _detach(kwargs))
        if len(graph.samples) < self.max_samples:
            graph.samples.append(sample)
            graph.outputs.append(_detach(output))
            graph.shapes.append(shapes)
        elif shapes not in graph.shapes:
            # keep the shape variety: replace a sample whose shapes are recorded twice
            for i, seen in enumerate(graph.shapes):
                if graph.shapes.count(seen) > 1:
                    graph.samples[i], graph.outputs[i], graph.shapes[i] = sample, _detach(output), shapes
                    break

    def _opens(self, module: W, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """A made-up call records: its graph is new (noted as made up) or one made-up calls opened, and its
        inputs and layout are ones the dataset's calls could have recorded."""
        rec = self.modules.get(id(module))
        try:
            key = structure_key(*module.canonicalizer(args, kwargs))
            _check_describable(args, kwargs, module.canonicalizer.arg_names)
        except Exception:
            return False
        graph = rec.graphs.get(key) if rec is not None else None
        if graph is None:
            self._made_up.add((id(module), key))
            return True
        return (id(module), key) in self._made_up and graph.layout == layout_of(args, kwargs)


def find_updates(graph: GraphRecording, forward: Callable[..., Any]) -> None:
    """Note which inputs ``graph``'s calls update in place by running ``forward`` (the module's own)
    once more on a copy of its first sample: for a recorder that sees a call only after it ran (the
    JIT's forward hook sees keyword arguments then, not before), so no version was read before it."""
    if graph.mutated or not graph.samples or graph.error or graph.eager_reason:
        return
    sample = graph.samples[0].fresh()
    leaves = sample.tensors()
    versions = _versions(leaves)
    before = Before(versions, _detach((sample.args, sample.kwargs)) if versions is None else None)
    with bypass(), torch.no_grad():
        forward(*sample.args, **sample.kwargs)
    changed = _changed(before, sample.args, sample.kwargs)
    graph.mutated.update(i for i, t in enumerate(leaves) if id(t) in changed)
