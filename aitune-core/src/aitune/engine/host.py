"""A tuned module's calls made on host numpy arrays: the dispatcher's own checks, then a backend's
``infer_host``, with no torch tensor made on either side.

A server holds a request's inputs as numpy arrays and answers with numpy arrays. Made into torch
tensors and back, a lone request to a small model pays for some thirty torch calls, and in a server
each costs 10-60 µs, because the requests between two of its own have cooled its caches
(benchmarks/README.md, "Issue 51"). A :class:`HostLane` serves calls by keyword of one set of input
names on a tuned ``ait.Module`` from the arrays themselves, where the dispatcher would send the call
to a backend that runs host arrays (:meth:`aitune.backend.Backend.runs_host_arrays`).

A lane answers only where the dispatcher would have sent the call to that backend, and declines
(None) everywhere else: a hook, a compiled or traced module, training mode, weights stale or to be
looked at again, a dtype or rank no graph takes, shapes outside every tuned range or in one that
eager won, an id outside its embedding, a backend that raises. The caller then makes tensors and
calls the module, whose dispatcher does what it always does, warnings and strict mode included.
A lane's calls compute no gradients: they are a server's inference calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from .. import tree
from ..backend import Backend
from .dispatch import EAGER, Dispatcher, Route, ShapeCheck
from .module import Module

logger = logging.getLogger("aitune")

MAX_SHAPES = 1024
"""Input shapes a lane remembers the route of (a server sees one per batch size and length)."""
_NOT_SEEN: Any = object()


class _HostRoute(NamedTuple):
    check: ShapeCheck
    backend: Backend | None
    """None: the dispatcher sends calls of these shapes to eager, or to a backend that needs tensors."""
    names: tuple[tuple[str, int], ...]
    """Each output's name and its place among the backend's flat outputs."""
    route: Route


class HostLane:
    """The calls by keyword of one set of input names on ``module``, served from host arrays (see the
    module's docstring). Made by :func:`host_lane`."""

    def __init__(
        self,
        module: Module,
        dispatcher: Dispatcher,
        paths: tuple[str, ...],
        kinds: tuple[tuple[Any, int], ...],
        routes: list[_HostRoute],
    ) -> None:
        self._module = module
        self._dispatcher = dispatcher
        self.paths = paths
        """The input names, in the order the graphs take them."""
        self._kinds = kinds  # per input, its numpy dtype and rank
        self._routes = routes
        self._fitted: dict[tuple[tuple[int, ...], ...], _HostRoute | None] = {}

    def __call__(self, request: Mapping[str, Any]) -> tuple[dict[str, Any], Route] | None:
        """The named outputs (numpy arrays) of the call ``module(**request)`` and how it was answered,
        or None where this lane declines it (the caller then makes the call with tensors)."""
        if self._module.direct_dispatcher() is not self._dispatcher or self._dispatcher.guard.blocks_host_call():
            return None
        arrays = [request[p] for p in self.paths]
        for a, (dtype, rank) in zip(arrays, self._kinds):
            if a.dtype != dtype or a.ndim != rank:
                return None
        shapes = tuple([a.shape for a in arrays])
        fit = self._fitted.get(shapes, _NOT_SEEN)  # one lookup: another thread may clear the dict between two
        if fit is _NOT_SEEN:
            fit = self._fit(arrays, shapes)
        if fit is None or fit.backend is None:
            return None
        values = fit.check.values
        if values is not None and values.outside_arrays(arrays):
            return None
        try:
            flat = fit.backend.infer_host(arrays)
        except Exception:  # the tensor path runs it again, and falls back to eager with its warning
            logger.debug("%s: the host-array call failed", self._dispatcher.name, exc_info=True)
            return None
        return {name: flat[i] for name, i in fit.names}, fit.route

    def _fit(self, arrays: list[Any], shapes: tuple[tuple[int, ...], ...]) -> _HostRoute | None:
        """The first route whose shape ranges hold these arrays, as the dispatcher picks (None: none)."""
        fit = next((r for r in self._routes if r.check.fits(arrays)), None)
        if len(self._fitted) >= MAX_SHAPES:
            self._fitted.clear()
        self._fitted[shapes] = fit
        return fit


def host_lane(
    model: torch.nn.Module,
    example: Mapping[str, torch.Tensor],
    name_outputs: Callable[[Any], Mapping[str, torch.Tensor]],
) -> HostLane | None:
    """A lane for calls ``model(**request)`` whose inputs have ``example``'s names, dtypes and ranks
    (its sizes do not matter), outputs named by ``name_outputs`` (what it makes of the module's
    output); None where no such call could be answered from host arrays: ``model`` is no tuned
    ``ait.Module``, no graph takes such a call by keyword, or none of its routes' backends runs arrays."""
    if not isinstance(model, Module) or model.tuned_dispatcher is None:
        return None
    dispatcher = model.tuned_dispatcher
    found = dispatcher.keyword_routes(dict(example))
    if not found:
        return None
    paths = tuple(t.path for t in found[0][0].graph.inputs)  # the graphs' own order (positional ones first)
    if sorted(paths) != sorted(example):
        return None
    try:
        kinds = tuple((example[p].numpy().dtype, example[p].dim()) for p in paths)
    except (RuntimeError, TypeError):  # no numpy dtype (bfloat16), not on the host
        return None
    routes = []
    for check, runner in found:
        backend = getattr(runner, "__self__", None)
        graph = check.graph
        takes = (
            runner is not dispatcher.eager
            and isinstance(backend, Backend)
            and backend.runs_host_arrays()
            and graph.output_structure is not None
            and tuple(t.path for t in graph.inputs) == paths
            and set(tree.leaf_kinds(graph.output_structure)) <= {"tensor"}
        )
        if not takes:
            routes.append(_HostRoute(check, None, (), Route(dispatcher.name, EAGER)))
            continue
        assert isinstance(backend, Backend) and graph.output_structure is not None
        markers = [torch.empty(0) for _ in tree.leaf_kinds(graph.output_structure)]
        place = {id(m): i for i, m in enumerate(markers)}
        named = name_outputs(tree.unflatten(graph.output_structure, markers))
        outputs = tuple((name, place[id(t)]) for name, t in named.items() if id(t) in place)
        routes.append(_HostRoute(check, backend, outputs, Route(dispatcher.name, backend.name)))
    if all(r.backend is None for r in routes):
        return None
    return HostLane(model, dispatcher, paths, kinds, routes)
