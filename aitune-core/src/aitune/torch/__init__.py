"""The aitune API: ``import aitune.torch as ait``.

model = ait.Module(model, "encoder", strategy=ait.MaxThroughputStrategy(backends=[...]))
ait.tune(model, dataset)
y = model(x)

A facade: every name here is defined below it (the engine in :mod:`aitune.engine`, the artifact in
:mod:`aitune.artifact`) and only re-exported, so importing any aitune module first leaves this API
as documented. The tuner's names (``tune``, ``inspect``, the strategies), ``save`` and ``TuneReport``
are imported on first use, so a process that only loads an artifact (a service starting) never
imports the tuner, the writer or the report's classes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..artifact import LoadOptions, load
from ..engine.dispatch import Route, observe_routes
from ..engine.module import Module
from ..engine.settings import settings as config
from ..engine.wrap import wrap
from ..graph import BatchDim, DynamicDim

if TYPE_CHECKING:
    from ..artifact.writer import save
    from ..engine.inspection import InspectResult, inspect
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
    from ..report import TuneReport

    HighestThroughputStrategy = MaxThroughputStrategy

_ON_USE = {
    "InspectResult": ("..engine.inspection", "InspectResult"),
    "inspect": ("..engine.inspection", "inspect"),
    "FirstWinsStrategy": ("..engine.strategies", "FirstWinsStrategy"),
    "LatencyBudgetStrategy": ("..engine.strategies", "LatencyBudgetStrategy"),
    "MaxThroughputStrategy": ("..engine.strategies", "MaxThroughputStrategy"),
    "HighestThroughputStrategy": ("..engine.strategies", "MaxThroughputStrategy"),
    "MinLatencyStrategy": ("..engine.strategies", "MinLatencyStrategy"),
    "OneBackendStrategy": ("..engine.strategies", "OneBackendStrategy"),
    "PerformanceValidationMode": ("..engine.strategies", "PerformanceValidationMode"),
    "TuneStrategy": ("..engine.strategies", "TuneStrategy"),
    "tune": ("..engine.tuner", "tune"),
    "TuneReport": ("..report", "TuneReport"),
    "save": ("..artifact.writer", "save"),
}
"""The tuner's names and the writer's, imported on first use. ``HighestThroughputStrategy`` is the name AITune's
overview gives ``MaxThroughputStrategy``; the same class."""


def __getattr__(name: str) -> Any:
    if name not in _ON_USE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _ON_USE[name]
    value = getattr(importlib.import_module(module, __name__), attr)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
