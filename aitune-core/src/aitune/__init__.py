"""aitune: make trained PyTorch models fast for inference without rewriting them.

The user-facing API lives in :mod:`aitune.torch`; a plugin (a backend, an executor) imports what it
builds on from :mod:`aitune.plugin`. This package holds the version and :data:`hookimpl`.
"""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("aitune")
"""Marker for hook implementations in aitune plugins: ``@aitune.hookimpl``."""

__all__ = ["__version__", "hookimpl"]
