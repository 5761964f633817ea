"""The onnxruntime backends (not implemented yet: building raises a clear error)."""

from __future__ import annotations

from aitune.backend import PendingBackend

from .config import ONNXRuntimeBackendConfig


class ONNXRuntimeBackend(PendingBackend):
    """ONNX export run by ONNX Runtime (CPU, CUDA or TensorRT execution provider)."""

    name = "onnxruntime"
    config_class = ONNXRuntimeBackendConfig
    planned = "issue 5"
