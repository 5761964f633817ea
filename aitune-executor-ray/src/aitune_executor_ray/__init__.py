"""Ray executor for aitune: each exported candidate build runs as a Ray task."""

__version__ = "0.1.0"
