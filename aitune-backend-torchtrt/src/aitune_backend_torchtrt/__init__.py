"""Torch-TensorRT backends for aitune: torch.compile and torch.export through Torch-TensorRT."""

__version__ = "0.1.0"
