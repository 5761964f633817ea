"""The aitune API: ``import aitune.torch as ait``.

model = ait.Module(model, "encoder", strategy=ait.MaxThroughputStrategy(backends=[...]))
ait.tune(model, dataset)
y = model(x)
"""

from __future__ import annotations

from ..artifact import load, save
from ..graph import BatchDim, DynamicDim
from ..report import TuneReport
from . import config
from .inspect import InspectResult, inspect
from .module import Module
from .strategies import (
    FirstWinsStrategy,
    LatencyBudgetStrategy,
    MaxThroughputStrategy,
    MinLatencyStrategy,
    OneBackendStrategy,
    PerformanceValidationMode,
    TuneStrategy,
)
from .tuner import tune
from .wrap import wrap

HighestThroughputStrategy = MaxThroughputStrategy
"""The name AITune's overview gives ``MaxThroughputStrategy``; the same class."""

__all__ = [
    "BatchDim",
    "DynamicDim",
    "FirstWinsStrategy",
    "HighestThroughputStrategy",
    "InspectResult",
    "LatencyBudgetStrategy",
    "MaxThroughputStrategy",
    "MinLatencyStrategy",
    "Module",
    "OneBackendStrategy",
    "PerformanceValidationMode",
    "TuneReport",
    "TuneStrategy",
    "config",
    "inspect",
    "load",
    "save",
    "tune",
    "wrap",
]
