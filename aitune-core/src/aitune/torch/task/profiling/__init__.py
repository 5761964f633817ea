"""AITune's profiling settings by their published path; defined in :mod:`aitune.profiling`."""

from __future__ import annotations

from ....profiling import (
    AllSamplesProfilingStopStrategy,
    CvMeasuringStopStrategy,
    MeasuringStopStrategy,
    ModelExecutionTimeMeasuringStrategy,
    NumStepsMeasuringStopStrategy,
    ProfileResult,
    ProfilingConfig,
    ProfilingStopStrategy,
    ThroughputSaturatedProfilingStopStrategy,
)

__all__ = [
    "AllSamplesProfilingStopStrategy",
    "CvMeasuringStopStrategy",
    "MeasuringStopStrategy",
    "ModelExecutionTimeMeasuringStrategy",
    "NumStepsMeasuringStopStrategy",
    "ProfileResult",
    "ProfilingConfig",
    "ProfilingStopStrategy",
    "ThroughputSaturatedProfilingStopStrategy",
]
