"""AITune's profiling stop strategies by their published path; defined in :mod:`aitune.profiling.stop`."""

from __future__ import annotations

from ....profiling.stop import (
    AllSamplesProfilingStopStrategy,
    ProfilingStopStrategy,
    ThroughputSaturatedProfilingStopStrategy,
)

__all__ = ["AllSamplesProfilingStopStrategy", "ProfilingStopStrategy", "ThroughputSaturatedProfilingStopStrategy"]
