"""TorchAO backend for aitune: quantization with an accuracy budget."""

__version__ = "0.1.0"
