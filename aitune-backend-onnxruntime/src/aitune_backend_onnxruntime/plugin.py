"""Registers the onnxruntime backends with aitune; imports no runtime."""

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
            name="onnxruntime",
            backend_class="aitune_backend_onnxruntime.backend:ONNXRuntimeBackend",
            config_class="aitune_backend_onnxruntime.config:ONNXRuntimeBackendConfig",
            requirements=('onnxruntime>=1.17', 'onnx>=1.16'),
            devices=("cpu", "cuda"),
            probe=_probe,
            description="ONNX export run by ONNX Runtime (CPU, CUDA or TensorRT execution provider)",
        )
    )
