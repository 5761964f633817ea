"""A tuned aitune artifact served on Ray Serve, on the Open Inference Protocol v2 (the kserve engine's
protocol), batched within the batch sizes it was tuned for.

``serve.run(aitune_serve_ray.deployment(build_model, "model.ait"))``, ``aitune serve model.ait
--factory package.module:build_model --engine ray``, or a Serve config file whose application's
``import_path`` is ``aitune_serve_ray:app`` (:func:`app`). See docs/serving.md, "Deploying".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__version__ = "0.1.0"

__all__ = ["TunedModel", "app", "deployment"]

APP_ARGS = (
    "artifact",
    "factory",
    "name",
    "replicas",
    "threads",
    "max_batch_size",
    "batch_wait_timeout_s",
    "max_rows",
    "pad",
    "max_ongoing_requests",
    "max_body_bytes",
    "read_timeout_s",
    "load_options",
    "autoscaling_config",
    "ray_actor_options",
    "deployment_options",
    "eager",
)
"""What a Serve config's ``args:`` may hold for :func:`app`."""


def app(args: Mapping[str, Any]) -> Any:
    """The Ray Serve application builder of a Serve config file (``serve run config.yaml``,
    ``serve deploy config.yaml``; ``serve build`` takes a built application, :func:`deployment`'s)::

        applications:
          - name: bert
            route_prefix: /
            import_path: aitune_serve_ray:app
            args:
              artifact: /models/bert.ait          # the same path on every node
              factory: mymodels:build_bert        # importable on every node
              max_batch_size: 8                   # rows per batch (default: the largest tuned)
              batch_wait_timeout_s: 0.005
              pad: {input_ids: 0, attention_mask: 0}  # requests of different lengths join one call
              load_options: {expected_sha256: ...}  # ait.load's options
              autoscaling_config: {min_replicas: 1, max_replicas: 4}

    ``artifact`` and ``factory`` are required; every other key is :func:`deployment`'s argument of
    that name (``autoscaling_config`` goes to its ``deployment_options``).
    """
    from .replica import deployment

    unknown = sorted(set(args) - set(APP_ARGS))
    if unknown:
        raise ValueError(
            f"unknown argument {', '.join(map(repr, unknown))} for aitune_serve_ray:app; it takes: {', '.join(APP_ARGS)}"
        )
    missing = [key for key in ("artifact", "factory") if not args.get(key)]
    if missing:
        raise ValueError(f"aitune_serve_ray:app needs {' and '.join(missing)} in its args")
    options = {k: v for k, v in args.items() if k not in ("artifact", "factory", "autoscaling_config")}
    if "autoscaling_config" in args:
        options["deployment_options"] = {
            **(options.get("deployment_options") or {}),
            "autoscaling_config": args["autoscaling_config"],
        }
    return deployment(args["factory"], args["artifact"], **options)


def __getattr__(name: str) -> Any:
    """Ray Serve is imported on first use: ``import aitune_serve_ray`` stays light."""
    if name in ("TunedModel", "deployment"):
        from . import replica

        return getattr(replica, name)
    raise AttributeError(f"module 'aitune_serve_ray' has no attribute {name!r}")
