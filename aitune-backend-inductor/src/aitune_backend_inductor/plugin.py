"""Registers the inductor backends with aitune; imports no runtime."""

from __future__ import annotations

from aitune import hookimpl
from aitune.registry import BackendRegistry, BackendSpec


def _probe(device: str) -> str | None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    return None


@hookimpl
def aitune_register_backends(registry: BackendRegistry) -> None:
    registry.add(
        BackendSpec(
            name="torch_inductor_jit",
            backend_class="aitune_backend_inductor.backend:TorchInductorJitBackend",
            config_class="aitune_backend_inductor.config:TorchInductorJitBackendConfig",
            requirements=(),
            devices=("cpu", "cuda"),
            probe=_probe,
            description="torch.compile with the inductor backend, compiled in the process",
        )
    )
    registry.add(
        BackendSpec(
            name="torch_inductor_aot",
            backend_class="aitune_backend_inductor.backend:TorchInductorAotBackend",
            config_class="aitune_backend_inductor.config:TorchInductorAotBackendConfig",
            requirements=(),
            devices=("cpu", "cuda"),
            probe=_probe,
            description="torch.export + AOTInductor, a .pt2 package that loads without compiling",
        )
    )
