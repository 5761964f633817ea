"""Recording real calls of wrapped modules while ``ait.tune`` runs the user's pipeline.

Calls are grouped by graph (input structure, in canonical form: positional and keyword calls of
the same parameters land together). Each graph keeps a few samples of distinct shapes, detached
copies so later in-place changes by the pipeline cannot alter them, plus the eager outputs.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import attrs
import torch

from .. import tree
from ..errors import InputError
from ..graph import Sample

if TYPE_CHECKING:
    from .module import Module

_state = threading.local()


def active_session() -> RecordingSession | None:
    return getattr(_state, "session", None)


def bypassing() -> bool:
    """True while aitune itself runs modules (building, validating): wrappers call through."""
    return getattr(_state, "bypass", 0) > 0


@contextlib.contextmanager
def bypass() -> Iterator[None]:
    _state.bypass = getattr(_state, "bypass", 0) + 1
    try:
        yield
    finally:
        _state.bypass -= 1


@contextlib.contextmanager
def recording(max_samples: int) -> Iterator[RecordingSession]:
    previous = active_session()
    session = RecordingSession(max_samples)
    _state.session = session
    try:
        yield session
    finally:
        _state.session = previous


class Canonicalizer:
    """Puts a call into canonical form: positional parameters in args, keyword-only in kwargs.

    Defaults are filled in, so ``f(x)`` and ``f(x, mask=None)`` are the same graph.
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
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        out_args: list[Any] = []
        out_kwargs: dict[str, Any] = {}
        for name, param in self.signature.parameters.items():
            value = bound.arguments[name]
            if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                out_args.append(value)
            elif param.kind == param.VAR_POSITIONAL:
                out_args.extend(value)
            elif param.kind == param.KEYWORD_ONLY:
                out_kwargs[name] = value
            else:
                out_kwargs.update(value)
        return tuple(out_args), out_kwargs


def structure_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The hashable graph key of a canonical call (see :func:`aitune.tree.call_key`)."""
    return tree.call_key((args, kwargs), [])


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    if isinstance(value, list):
        return [_detach(v) for v in value]
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


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
    except InputError as exc:
        raise InputError(
            f"{exc}. Return tensors in tuples, lists or dicts (for a dataclass, e.g. dataclasses.astuple), "
            "or wrap the submodule that returns tensors instead"
        ) from exc


@attrs.define
class GraphRecording:
    """The samples and eager outputs recorded for one graph of one module."""

    samples: list[Sample] = attrs.field(factory=list)
    outputs: list[Any] = attrs.field(factory=list)
    shapes: list[tuple[tuple[int, ...], ...]] = attrs.field(factory=list)
    calls: int = 0
    error: str | None = None


@attrs.define
class ModuleRecording:
    module: Module
    graphs: dict[Any, GraphRecording] = attrs.field(factory=dict)
    calls: int = 0


class RecordingSession:
    """Everything wrapped modules saw during one ``ait.tune`` run, in first-call order."""

    def __init__(self, max_samples: int) -> None:
        self.max_samples = max_samples
        self.modules: dict[int, ModuleRecording] = {}

    def record(self, module: Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        rec = self.modules.setdefault(id(module), ModuleRecording(module))
        rec.calls += 1
        try:
            args, kwargs = module._canonicalize(args, kwargs)
            names = module._canonicalize.arg_names
            for i, value in enumerate(args):  # refuses inputs aitune cannot describe, naming the path
                tree.flatten(value, names[i] if i < len(names) else f"args.{i}")
            for name, value in kwargs.items():
                tree.flatten(value, name)
            _check_finite(args, kwargs, names)
            _check_output(output)
            key = structure_key(args, kwargs)
            graph = rec.graphs.setdefault(key, GraphRecording())
            graph.calls += 1
        except Exception as exc:
            graph = rec.graphs.setdefault(("unsupported", type(exc).__name__, str(exc)), GraphRecording())
            graph.calls += 1
            graph.error = f"{type(exc).__name__}: {exc}"
            return
        shapes = _shapes(args, kwargs)
        sample = Sample(_detach(args), _detach(kwargs))
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
