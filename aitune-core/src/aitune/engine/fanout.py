"""Every build of a pipeline handed to a concurrent executor right after recording.

A strategy builds its candidates one after the other. When the tune's executor runs builds side
by side (a Ray cluster), waiting for each in turn would waste it, so the builds that run in a
worker are exported and submitted here, all at once; the strategy's own ``build`` then takes the
finished result (see :meth:`aitune.builds.queue.TuneBuildQueue.take`). FirstWins builds lazily by its
rules, so only its first candidate goes ahead
(:meth:`~.strategies.TuneStrategy.builds_ahead`: each strategy says which, of its candidates in
:meth:`~.strategies.TuneStrategy.build_order`, the order its ``tune`` builds them in).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..backend import BuildContext
from ..errors import AituneError
from . import plan, recording
from .plan import ModulePlan, TuneRun

logger = logging.getLogger("aitune")


def submit_ahead(plans: Sequence[ModulePlan], run: TuneRun) -> int:
    """Submit every build each graph's strategy is sure to ask for; returns how many went ahead."""
    builds = run.session.builds
    if builds is None or not builds.executor.concurrent:
        return 0
    from ..cachedir import cache_dir

    registry, device = run.registry, run.device
    submitted = 0
    for graph_plan in plan.graphs(plans):
        if graph_plan.not_tuned:
            continue
        try:
            graph = graph_plan.graph
        except AituneError:
            continue  # the strategy's turn reports it
        strategy = graph_plan.strategy
        for template in strategy.builds_ahead(strategy.build_order(run.defaults, run.progress)):
            backend = template.clone()
            if not builds.beside(backend) or registry.unavailable(backend, device, graph):
                continue  # built in this process when its turn comes
            module, samples = graph_plan.module, graph_plan.recorded.samples
            context = BuildContext(graph, samples, device, builds.folder(), cache_dir(), module.name)
            label = f"{module.name}: {backend.name}" + (f" ({backend.variant()})" if backend.variant() else "")
            with (
                run.progress.step(f"{label}: export for a build ahead", "export", [label]),
                torch.no_grad(),
                recording.bypass(),
            ):
                submitted += builds.submit_ahead(backend, module.module, context)
    if submitted:
        logger.info("%d builds submitted to the %s executor", submitted, builds.executor.name)
    return submitted
