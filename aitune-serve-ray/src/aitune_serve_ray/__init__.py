"""A tuned aitune artifact served on Ray Serve, batched within the batch sizes it was tuned for.

``serve.run(aitune_serve_ray.deployment(build_model, "model.ait"))``, or ``aitune serve model.ait
--factory package.module:build_model``. See docs/serving.md, "Deploying".
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["TunedModel", "deployment"]


def __getattr__(name: str) -> Any:
    """Ray Serve is imported on first use: ``import aitune_serve_ray`` stays light."""
    if name in __all__:
        from . import app as module

        return getattr(module, name)
    raise AttributeError(f"module 'aitune_serve_ray' has no attribute {name!r}")
