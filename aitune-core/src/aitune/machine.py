"""What a figure was measured on: the machine, the software and the thread settings.

The tuner stamps it on a report, the artifact writer on a manifest (its fingerprint) and the JIT on a
remembered decision; it lives in the foundation so that none of them reaches into another for it.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch


def environment(device: torch.device) -> dict[str, Any]:
    """What the figures were measured on."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (the OpenMP runtime's default)"),
        "thread_settings": {k: os.environ[k] for k in _THREAD_VARS if k in os.environ},
        "cuda": torch.version.cuda,
        "load_average_start": load_average(),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        env["gpu"] = torch.cuda.get_device_name(index)
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(index)))
    return env


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none): a figure measured
    while other programs ran says so."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


_THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "KMP_BLOCKTIME", "OPENBLAS_NUM_THREADS")
"""Settings that change CPU timings a lot (a busy 2-core machine swings eager latency 5x without them)."""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
