"""Registers the tensorrt backends with aitune; imports no runtime."""

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
            name="tensorrt",
            backend_class="aitune_backend_tensorrt.backend:TensorRTBackend",
            config_class="aitune_backend_tensorrt.config:TensorRTBackendConfig",
            requirements=('tensorrt>=10.0',),
            devices=("cuda",),
            probe=_probe,
            install_hint="pip install 'aitune-backend-tensorrt[runtime]'",
            description="TensorRT engine built from the ONNX export",
        )
    )
