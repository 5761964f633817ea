"""The entry point's module: declares the backend to aitune and imports nothing heavy."""

from __future__ import annotations

from aitune.plugin import BackendRegistrar, BackendSpec, hookimpl


@hookimpl
def aitune_register_backends(registry: BackendRegistrar) -> None:
    registry.add(
        BackendSpec(
            # name, config class and devices come from the class; its module imports only torch and aitune
            backend_class="aitune_backend_example.backend:ChannelsLastBackend",
            description="channels-last (NHWC) weights and inputs, BatchNorm folded into the Conv before it",
            # Opt-in: installing this distribution must not change what everyone's default tune tries.
            default_candidate=False,
        )
    )
