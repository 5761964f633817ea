"""Every build of a pipeline handed to a concurrent executor right after recording.

A strategy builds its candidates one after the other. When the tune's executor runs builds side
by side (a Ray cluster), waiting for each in turn would waste it, so the builds that run in a
worker are exported and submitted here, all at once; the strategy's own ``build`` then takes the
finished result (see :meth:`aitune.builds.queue.BuildSession.take`). FirstWins builds lazily by its
rules, so only its first candidate goes ahead.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..backend import BuildContext
from ..builds import isolation
from ..errors import AituneError
from . import recording
from .plan import TuneRun, graph_of, strategy_for
from .strategies import FirstWinsStrategy

if TYPE_CHECKING:
    from .module import Module

logger = logging.getLogger("aitune")


def submit_ahead(recordings: Sequence[recording.ModuleRecording[Module]], run: TuneRun) -> int:
    """Submit every candidate build of every recorded graph; returns how many went ahead."""
    session = run.session.builds
    if session is None or not session.executor.concurrent:
        return 0
    from ..cachedir import cache_dir

    registry, device = run.registry, run.device
    submitted = 0
    for rec in recordings:
        module = rec.module
        for index, graph_rec in enumerate(rec.graphs.values()):
            if graph_rec.error or graph_rec.eager_reason:
                continue
            try:
                graph = graph_of(module, graph_rec, run.sizes_for(graph_rec))
            except AituneError:
                continue  # the strategy's turn reports it
            strategy = strategy_for(module, index, graph.key)
            templates = strategy.candidates(run.defaults)
            if isinstance(strategy, FirstWinsStrategy):
                templates = templates[:1]
            for template in templates:
                backend = template.clone()
                if not isolation.isolated(backend) or registry.unavailable(backend, device, graph):
                    continue  # built in this process when its turn comes
                context = BuildContext(graph, graph_rec.samples, device, session.folder(), cache_dir(), module.name)
                label = f"{module.name}: {backend.name}" + (f" ({backend.variant()})" if backend.variant() else "")
                with (
                    run.progress.step(f"{label}: export for a build ahead", "export", [label]),
                    torch.no_grad(),
                    recording.bypass(),
                ):
                    submitted += session.submit_ahead(backend, module.module, context)
    if submitted:
        logger.info("%d builds submitted to the %s executor", submitted, session.executor.name)
    return submitted
