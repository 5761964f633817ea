"""A fault backend for the Ray executor's tests: its first build kills the Ray worker running it.

Register it with ``register_plugin(aitune_testkit.ray_faults)`` next to
:mod:`aitune.testing.backends`. Only for Ray: with the local executor the process it kills is
the user's own.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from aitune import hookimpl
from aitune.backend import BackendConfig, BuildContext
from aitune.registry import BackendRegistry
from aitune.testing.backends import register
from aitune_testkit.faults import IsolatedToyBackend


class KillsRayWorkerOnceBackend(IsolatedToyBackend):
    """The first build of a graph (per marker folder) SIGKILLs the Ray worker that runs it, as a
    preempted node or the kernel's out-of-memory killer would; Ray's retry then builds normally."""

    name = "fault_kill_ray_worker_once"

    def export(self, module: torch.nn.Module, context: BuildContext, directory: Path) -> dict[str, Any] | None:
        notes = super().export(module, context, directory) or {}
        return {**notes, "marker": str(Path(context.cache_dir) / "fault-kill-ray-worker-once" / context.graph.key)}

    @classmethod
    def build_exported(
        cls, config: BackendConfig, exported: Path, notes: dict[str, Any], context: BuildContext, payload: Path
    ) -> dict[str, Any]:
        marker = Path(notes["marker"])
        if not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(str(os.getppid()))
            os.kill(os.getppid(), signal.SIGKILL)  # the Ray worker; this process follows it
            time.sleep(60)
        return super().build_exported(config, exported, notes, context, payload)


@hookimpl
def aitune_register_backends(registry: BackendRegistry) -> None:
    register(registry, (KillsRayWorkerOnceBackend,), __name__)
