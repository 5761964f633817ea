"""Torch Inductor backends for aitune: torch.compile (JIT) and AOTInductor packages (AOT)."""

__version__ = "0.1.0"
