"""The aitune API: ``import aitune.torch as ait``.

model = ait.Module(model, "encoder", strategy=ait.MaxThroughputStrategy(backends=[...]))
ait.tune(model, dataset)
y = model(x)

A facade: every name here is defined below it (the engine in :mod:`aitune.engine`, the artifact in
:mod:`aitune.artifact`) and only re-exported, so importing any aitune module first leaves this API
as documented.
"""

from __future__ import annotations

import sys

from ..artifact import LoadOptions, load, save
from ..engine.dispatch import Route, observe_routes
from ..engine.inspection import InspectResult, inspect
from ..engine.module import Module
from ..engine.settings import settings as config
from ..engine.strategies import (
    FirstWinsStrategy,
    LatencyBudgetStrategy,
    MaxThroughputStrategy,
    MinLatencyStrategy,
    OneBackendStrategy,
    PerformanceValidationMode,
    TuneStrategy,
)
from ..engine.tuner import tune
from ..engine.wrap import wrap
from ..graph import BatchDim, DynamicDim
from ..report import TuneReport

# `import aitune.torch.config` finds the settings object (not a module, hence the ignore)
sys.modules[f"{__name__}.config"] = config  # type: ignore[assignment]

HighestThroughputStrategy = MaxThroughputStrategy
"""The name AITune's overview gives ``MaxThroughputStrategy``; the same class."""

__all__ = [
    "BatchDim",
    "DynamicDim",
    "FirstWinsStrategy",
    "HighestThroughputStrategy",
    "InspectResult",
    "LatencyBudgetStrategy",
    "LoadOptions",
    "MaxThroughputStrategy",
    "MinLatencyStrategy",
    "Module",
    "OneBackendStrategy",
    "PerformanceValidationMode",
    "Route",
    "TuneReport",
    "TuneStrategy",
    "config",
    "inspect",
    "load",
    "observe_routes",
    "save",
    "tune",
    "wrap",
]
