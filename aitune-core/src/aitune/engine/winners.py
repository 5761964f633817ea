"""Winners and the dispatcher that routes a tuned module's calls to them.

A graph's decision is its :class:`Winner` list: each a graph spec (the whole graph, or one batch
range of it) and the backend that serves it. The tuner turns a strategy's answer into one
(:func:`winners_of`); the ranks rebuild rank 0's, the artifact reader loads them, the JIT reuses
the tuner's. :mod:`.install` puts them on a module through :func:`dispatcher_for`, which puts the
guard (inference only, weights unchanged) in front of the winners.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch

from ..backend import Backend
from ..builtin.eager import TorchEagerBackend
from ..graph import GraphSpec, narrow
from .dispatch import Dispatcher
from .guard import Guard, Layout
from .recording import Canonicalizer


class Winner(NamedTuple):
    """Calls that fit ``graph`` run on ``backend`` (eager's own backend keeps them eager, silently)."""

    graph: GraphSpec
    backend: Backend


def winners_of(graph: GraphSpec, answer: Any, eager: Backend) -> list[Winner]:
    """A strategy's answer as winners: a candidate (or None, for eager), or a list of batch-range routes."""
    if isinstance(answer, list):  # one backend per batch range
        return [
            Winner(narrow(graph, r.batch_min, r.batch_max), r.candidate.backend if r.candidate is not None else eager)
            for r in answer
        ]
    return [Winner(graph, answer.backend if answer is not None else eager)]


def eager_only(routes: Sequence[Winner]) -> bool:
    return all(isinstance(r.backend, TorchEagerBackend) for r in routes)


def dispatcher_for(
    name: str,
    module: torch.nn.Module,
    eager: Callable[..., Any],
    canonicalize: Canonicalizer,
    routes: Sequence[Winner],
    strict: bool = False,
    watched: Iterable[torch.nn.Module] = (),
    built_with: Layout | None = None,
) -> Dispatcher:
    """The guard and the dispatcher that route ``module``'s inference calls to ``routes``.

    Eager routes call ``eager`` (no warning: eager won them); winners that baked the weights in
    stop being used once the guard sees the weights change, and every winner once the hooks of a
    ``watched`` module (those the tuned call skips) change.
    """
    runners = [(r.graph, eager if isinstance(r.backend, TorchEagerBackend) else r.backend.infer) for r in routes]
    baked = [r for r in routes if not r.backend.follows_weights()]
    guard = Guard(
        module,
        [r.backend.name for r in baked],
        watched,
        refittable=[(r.graph, r.backend) for r in baked],
        reference=eager,
        built_with=built_with,
    )
    return Dispatcher(name, eager, canonicalize, runners, strict, guard=guard)
