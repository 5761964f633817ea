"""ONNX Runtime backend for aitune: ONNX export and ONNX Runtime on CPU, CUDA and TensorRT providers."""

__version__ = "0.1.0"
