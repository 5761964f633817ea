"""The tensorrt backends (not implemented yet: building raises a clear error)."""

from __future__ import annotations

from aitune.backend import PendingBackend

from .config import TensorRTBackendConfig


class TensorRTBackend(PendingBackend):
    """TensorRT engine built from the ONNX export."""

    name = "tensorrt"
    config_class = TensorRTBackendConfig
    planned = "issue 11"
