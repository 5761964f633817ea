"""An example third-party aitune backend: channels-last memory format with Conv+BatchNorm folding."""

__version__ = "0.1.0"
