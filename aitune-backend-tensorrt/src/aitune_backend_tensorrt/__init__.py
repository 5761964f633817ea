"""TensorRT backend for aitune: ONNX to TensorRT engines, ModelOpt precision, CUDA graphs.

Importing this package imports neither TensorRT, ModelOpt nor ONNX: those load inside
``build`` and ``load``, after the machine has been checked.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .backend import TensorRTBackend
from .config import ModelOptQuantizationConfig, ONNXAutoCastConfig, TensorRTBackendConfig, TensorRTProfile

__all__ = [
    "ModelOptQuantizationConfig",
    "ONNXAutoCastConfig",
    "TensorRTBackend",
    "TensorRTBackendConfig",
    "TensorRTProfile",
]
