"""A tuned aitune artifact served on KServe's ``ModelServer`` (the Open Inference Protocol v2, REST and
gRPC), batched within the batch sizes it was tuned for.

``aitune serve model.ait --factory package.module:build_model`` (the default engine), or from Python
``aitune_serve_kserve.serve(build_model, "model.ait")``. See docs/serving.md, "Deploying".
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["TunedModel", "serve", "serve_models"]


def __getattr__(name: str) -> Any:
    """kserve is imported on first use: ``import aitune_serve_kserve`` stays light."""
    if name == "TunedModel":
        from .model import TunedModel

        return TunedModel
    if name in ("serve", "serve_models"):
        from . import launch

        return getattr(launch, name)
    raise AttributeError(f"module 'aitune_serve_kserve' has no attribute {name!r}")
