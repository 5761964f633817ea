"""Core's default implementation of every operation hook, registered ``trylast``.

Each one calls the Backend object's own method (or core's validator and profiler), so a plugin
that returns a result first pre-empts it, and a ``wrapper=True`` implementation can wrap it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import hookimpl
from ..backend import Backend, BuildContext, LoadContext
from ..graph import GraphSpec, Sample

if TYPE_CHECKING:  # the report's classes are the tuner's: a load, which registers these hooks, never imports them
    from ..report import ProfileResult, ValidationReport


@hookimpl(trylast=True)
def aitune_build(backend: Backend, module: torch.nn.Module, context: BuildContext) -> Backend:
    backend.build(module, context)
    return backend


@hookimpl(trylast=True)
def aitune_validate(
    backend: Backend,
    reference: Callable[..., Any],
    samples: Sequence[Sample],
    graph: GraphSpec,
    tolerances: Mapping[str, Any] | None,
    masked_by: str | None,
) -> ValidationReport:
    from ..validation import validate

    return validate(backend, reference, samples, graph, tolerances, masked_by)


@hookimpl(trylast=True)
def aitune_profile(
    runners: Mapping[str, Callable[[], Any]], batch_size: int, config: Any, device: torch.device
) -> Mapping[str, ProfileResult]:
    from ..profiling import profile_runners

    return profile_runners(runners, batch_size, config, device)


@hookimpl(trylast=True)
def aitune_serialize(backend: Backend, directory: Path) -> dict[str, Any]:
    return backend.save(directory)


@hookimpl(trylast=True)
def aitune_deserialize(backend: Backend, module: torch.nn.Module, directory: Path, context: LoadContext) -> Backend:
    backend.load(module, directory, context)
    return backend
