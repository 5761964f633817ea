"""The entry point aitune loads: declares the ``ray`` executor. Imports nothing heavy (not even Ray)."""

from __future__ import annotations

from aitune.plugin import ExecutorRegistrar, ExecutorSpec, hookimpl


@hookimpl
def aitune_register_executors(registry: ExecutorRegistrar) -> None:
    registry.add(
        ExecutorSpec(
            name="ray",
            executor_class="aitune_executor_ray.executor:RayExecutor",
            requirements=("ray>=2.9",),
            description="Ray tasks on a cluster (RAY_ADDRESS, a running cluster, or a local one)",
        )
    )
