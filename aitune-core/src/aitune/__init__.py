"""aitune: make trained PyTorch models fast for inference without rewriting them.

The user-facing API lives in :mod:`aitune.torch`; this package holds the plugin contract
(:mod:`aitune.hookspecs`, :data:`hookimpl`, :mod:`aitune.registry`) that backends build on.
"""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("aitune")
"""Marker for hook implementations in aitune plugins: ``@aitune.hookimpl``."""

__all__ = ["__version__", "hookimpl"]
