"""TensorRT backend for aitune: ONNX to TensorRT engines, ModelOpt precision, CUDA graphs."""

__version__ = "0.1.0"
