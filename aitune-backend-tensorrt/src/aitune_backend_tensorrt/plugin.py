"""Registers the tensorrt backend with aitune; imports no runtime (TensorRT is never loaded here)."""

from __future__ import annotations

from aitune.plugin import BackendRegistrar, BackendSpec, hookimpl

from .compat import INSTALL_HINT, availability_reason


def _probe(device: str) -> str | None:
    return availability_reason(device)


@hookimpl
def aitune_register_backends(registry: BackendRegistrar) -> None:
    # No ``requirements``: TensorRT ships under several distribution names (tensorrt,
    # tensorrt-cu12, an NGC container's own), so the probe looks for any of them.
    registry.add(
        BackendSpec(
            name="tensorrt",
            backend_class="aitune_backend_tensorrt.backend:TensorRTBackend",
            config_class="aitune_backend_tensorrt.config:TensorRTBackendConfig",
            exports={
                "TensorRTProfile": "aitune_backend_tensorrt.config:TensorRTProfile",
                "ONNXAutoCastConfig": "aitune_backend_tensorrt.config:ONNXAutoCastConfig",
                "ModelOptQuantizationConfig": "aitune_backend_tensorrt.config:ModelOptQuantizationConfig",
            },
            devices=("cuda",),
            probe=_probe,
            install_hint=INSTALL_HINT,
            description="TensorRT engine built from the ONNX export (profiles, ModelOpt precision, CUDA graphs)",
        )
    )
