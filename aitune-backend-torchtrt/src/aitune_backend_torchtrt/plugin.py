"""Registers the torchtrt backends with aitune; imports no runtime."""

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
            name="torch_tensorrt_jit",
            backend_class="aitune_backend_torchtrt.backend:TorchTensorRTJitBackend",
            config_class="aitune_backend_torchtrt.config:TorchTensorRTJitBackendConfig",
            requirements=('torch-tensorrt>=2.6',),
            devices=("cuda",),
            probe=_probe,
            install_hint="pip install 'aitune-backend-torchtrt[runtime]'",
            description="torch.compile(backend='torch_tensorrt')",
        )
    )
    registry.add(
        BackendSpec(
            name="torch_tensorrt_aot",
            backend_class="aitune_backend_torchtrt.backend:TorchTensorRTAotBackend",
            config_class="aitune_backend_torchtrt.config:TorchTensorRTAotBackendConfig",
            requirements=('torch-tensorrt>=2.6',),
            devices=("cuda",),
            probe=_probe,
            install_hint="pip install 'aitune-backend-torchtrt[runtime]'",
            description="torch.export compiled by Torch-TensorRT, saved in its deployable form",
        )
    )
