"""The Ray Serve deployment: each replica builds the model, loads the artifact into it and answers the
Open Inference Protocol v2 over REST, in batches that Ray Serve's own ``serve.batch`` forms within
the batch sizes the artifact was tuned for.

The protocol is the single-machine engine's, not a second one: the replica serves the kserve
engine's model (:class:`aitune_serve_kserve.TunedModel`: load, warm-up, metadata from the tuned
graphs, the request checked against the tuned inputs, the response with its ``aitune_*``
parameters) through kserve's own REST routes, codecs and error handlers
(:func:`aitune_serve_kserve.protocol.v2_app`) as the replica's ASGI app. What is Ray's here: the
queue (``serve.batch``, counted in rows), the metrics (Ray Serve's), the replicas, their placement
and their replacement.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch
from ray import serve

import aitune.torch as ait
from aitune.torch.serving import ClientError, Factory, tuned_threads
from aitune_serve_kserve.limits import MAX_BODY_BYTES, READ_TIMEOUT_S, BodyLimits

if TYPE_CHECKING:
    from .model import ReplicaModel

logger = logging.getLogger("aitune.serve")

BATCH_WAIT_S = 0.005
MAX_ONGOING_REQUESTS = 256
"""Requests a replica holds at once (Ray Serve's ``max_ongoing_requests``). Ray's proxy hands a
request to a replica when its headers come, so a client that stalls its body holds a slot until the
read timeout drops it; the model's own work is bounded by the batch size, not by this, so it is
set well above what slow clients can hold (issue 52: 70 stalled uploads left no slot of 64)."""


@serve.deployment(max_ongoing_requests=MAX_ONGOING_REQUESTS)
@serve.ingress()
class TunedModel:
    """One replica: ``factory()`` loaded with the artifact, served as model ``name`` on the Open
    Inference Protocol v2 (``/v2/models/{name}/infer``...), and to other deployments through its
    handle (:meth:`infer`)."""

    def __init__(
        self,
        factory: Factory | str,
        artifact: str,
        name: str | None = None,
        threads: int | None = None,
        load_options: Any = None,
        max_batch_size: int | None = None,
        batch_wait_timeout_s: float = BATCH_WAIT_S,
        max_rows: int | None = None,
        pad: Mapping[str, float] | None = None,
        eager: bool = False,
        batching: bool = True,
        max_body_bytes: int = MAX_BODY_BYTES,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        from .model import ReplicaModel  # kserve is imported in the replica only (see .model)

        self.limits = {"max_body_bytes": max_body_bytes, "read_timeout_s": read_timeout_s}
        self.model: ReplicaModel = ReplicaModel(
            name or Path(artifact).stem,
            factory,
            artifact,
            load_options=load_options,
            threads=threads,
            eager=eager,
            max_rows=max_rows,
            pad=pad,
            max_batch_size=max_batch_size,
            batch_wait_timeout_s=batch_wait_timeout_s,
            batching=batching,
        )
        self.model.load()

    def __serve_build_asgi_app__(self) -> Any:
        """The replica's HTTP side: kserve's v2 routes over this replica's model, request bodies read
        within the kserve engine's limits (a size cap while the body streams, a read timeout). Ray
        Serve calls it once the model is loaded."""
        from aitune_serve_kserve.protocol import v2_app

        app = v2_app([self.model])
        app.add_middleware(BodyLimits, **self.limits)
        return app

    async def infer(
        self, inputs: Mapping[str, np.ndarray | torch.Tensor], outputs: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """The model's outputs for named tensors (numpy arrays or CPU tensors, the batch axis
        included), through the same checks and batches as an HTTP request: what another deployment
        calls through a handle (``await handle.infer.remote({"input_ids": ids})``). ``outputs``
        selects some. A request the model cannot take raises
        :class:`aitune.torch.serving.ClientError` (a ``ValueError``) saying what to send, as the
        protocol's 400 does."""
        from kserve.errors import InvalidInput
        from kserve.protocol.infer_type import InferInput, InferRequest, RequestedOutput
        from kserve.utils.numpy_codec import from_np_dtype

        tensors = []
        for name, value in inputs.items():
            array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            tensors.append(InferInput(name, list(array.shape), from_np_dtype(array.dtype) or "BYTES", data=array))
        wanted = [RequestedOutput(name) for name in outputs] if outputs else None
        request = InferRequest(self.model.name, tensors, request_outputs=wanted)
        try:
            response = await self.model.predict(request)
        except InvalidInput as exc:  # kserve's type: a caller need not import kserve to catch it
            raise ClientError(str(exc)) from None
        return {output.name: output.as_numpy() for output in response.outputs}

    async def check_health(self) -> None:
        """Ray Serve's periodic health check: the model's own readiness (loaded, and a model call
        answered lately or made now); a replica that fails it is replaced."""
        if not await self.model.healthy():
            raise RuntimeError(f"model {self.model.name!r} is not healthy: see the replica's log")

    def stats(self) -> dict[str, Any]:
        """This replica's metrics so far (what it exports to Ray's metrics, as numbers), and what it
        serves."""
        return {
            "model": self.model.name,
            "inputs": [spec["name"] for spec in self.model.get_input_types()],
            "tuned_batch_sizes": [list(r) for r in self.model.plan.ranges],
            "threads": self.model.threads,
            **self.model.metrics.snapshot(),
            "pid": os.getpid(),
        }


def deployment(
    factory: Factory | str,
    artifact: str | Path,
    *,
    name: str | None = None,
    replicas: int = 1,
    threads: int | None = None,
    max_batch_size: int | None = None,
    batch_wait_timeout_s: float = BATCH_WAIT_S,
    max_rows: int | None = None,
    pad: Mapping[str, float] | None = None,
    max_ongoing_requests: int = MAX_ONGOING_REQUESTS,
    max_body_bytes: int = MAX_BODY_BYTES,
    read_timeout_s: float = READ_TIMEOUT_S,
    ray_actor_options: dict[str, Any] | None = None,
    deployment_options: dict[str, Any] | None = None,
    load_options: ait.LoadOptions | Mapping[str, Any] | None = None,
    expected_sha256: str | None = None,
    trusted_keys: Sequence[str | Path] | None = None,
    signature: str | Path | None = None,
    trust_native_code: bool = False,
    weights: str | None = None,
    fallback: str | None = None,
    eager: bool = False,
    batching: bool = True,
) -> serve.Application:
    """A Ray Serve application serving ``artifact`` loaded into ``factory()`` as model ``name``
    (default: the artifact's stem) on the Open Inference Protocol v2 (``serve.run`` it).

    ``factory`` is a callable or ``"package.module:name"`` that every replica can import; it returns
    the model freshly built, as ``ait.load`` takes it. ``load_options`` are ``ait.load``'s (an
    ``ait.LoadOptions`` or a mapping of its keyword arguments), or give the trust ones as keyword
    arguments here (``expected_sha256``, ``trusted_keys``...), not both: a native payload runs only
    from a pinned, signed or trusted artifact. ``threads`` (default: what the artifact was tuned
    with) is each replica's torch thread count and its Ray CPU request. ``artifact`` must be readable
    at the same path on every node that runs a replica.

    Batching is Ray Serve's ``serve.batch``: a batch holds up to ``max_batch_size`` rows (default:
    the largest tuned batch size) and waits up to ``batch_wait_timeout_s`` for them; ``max_rows``
    caps one request's rows (default eight largest tuned batches). ``pad`` (input name -> pad value,
    as ``aitune serve --pad``) adds to the padding the artifact declares: requests of different
    lengths then join one call, each answer cut back to its own length. A request body over
    ``max_body_bytes`` is refused (413) as soon as that many bytes came; one that stalls for
    ``read_timeout_s`` is dropped (408).

    ``deployment_options`` go to Ray Serve's ``Deployment.options`` as they are (``autoscaling_config``,
    ``health_check_period_s``...); with ``autoscaling_config``, ``replicas`` is left to it.

    Baselines for load tests and A/B comparisons: ``eager=True`` serves the factory's model with
    the artifact's weights and batching but none of its tuned backends; ``batching=False`` makes
    each request one model call, as sent.
    """
    path = Path(artifact).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{artifact}: no such artifact")
    for label, value in (("replicas", replicas), ("threads", threads), ("max_batch_size", max_batch_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{label} must be an int >= 1, got {value!r}")
    trust = {
        "expected_sha256": expected_sha256,
        "trusted_keys": trusted_keys,
        "signature": signature,
        "trust_native_code": trust_native_code,
        "weights": weights,
        "fallback": fallback,
    }
    given = {k: v for k, v in trust.items() if v not in (None, False)}
    if load_options is not None and given:
        raise ValueError(
            f"give ait.load's options once: as load_options, or as keyword arguments ({', '.join(given)}), not both"
        )
    options = ait.LoadOptions.of(load_options if load_options is not None else given)
    # replicas may run elsewhere than here (another working directory, another node): absolute paths
    options = attrs.evolve(
        options,
        trusted_keys=[str(Path(k).resolve()) for k in options.trusted_keys] if options.trusted_keys else None,
        signature=str(Path(options.signature).resolve()) if options.signature else None,
    )
    per_replica = threads or tuned_threads(path) or 1
    actor = {"num_cpus": per_replica, **(ray_actor_options or {})}
    chosen = {"ray_actor_options": actor, "max_ongoing_requests": max_ongoing_requests, **(deployment_options or {})}
    if "autoscaling_config" not in chosen:
        chosen["num_replicas"] = replicas
    # TunedModel is a Ray Serve Deployment: mypy keeps a decorated class's own type (python/mypy#3135)
    return TunedModel.options(**chosen).bind(  # type: ignore[attr-defined]
        factory,
        str(path),
        name=name or path.stem,
        threads=threads,
        load_options=options,
        max_batch_size=max_batch_size,
        batch_wait_timeout_s=batch_wait_timeout_s,
        max_rows=max_rows,
        pad=dict(pad) if pad else None,
        eager=eager,
        batching=batching,
        max_body_bytes=max_body_bytes,
        read_timeout_s=read_timeout_s,
    )
