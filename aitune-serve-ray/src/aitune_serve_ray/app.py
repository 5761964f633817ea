"""The Ray Serve deployment: each replica builds the model, loads the artifact into it, and answers
HTTP requests in batches of the sizes the artifact was tuned for (Ray Serve's own ``serve.batch``)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import attrs
import torch
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import aitune.torch as ait
from aitune.torch.serving import (
    Answer,
    BatchPlan,
    ClientError,
    Factory,
    input_specs,
    resolve_factory,
    tuned_threads,
)

from .batching import BatchRunner
from .codec import BadRequest, body_format, decode, encode
from .metrics import Metrics

logger = logging.getLogger("aitune.serve")

MAX_BODY_BYTES = 64 * 1024 * 1024


@attrs.frozen
class _Item:
    """One decoded request waiting for its batch."""

    tensors: dict[str, torch.Tensor]
    weight: int
    """Its rows, counted at most up to the largest tuned batch size (a larger one is split)."""
    arrived: float


def _weight(items: Sequence[_Item]) -> int:
    return sum(item.weight for item in items)


class _BatchSettings(Protocol):
    """What a ``@serve.batch`` method offers besides its call (Ray documents both setters; its type
    hints give the decorated method only its call)."""

    def set_max_batch_size(self, new_max_batch_size: int) -> None: ...

    def set_batch_wait_timeout_s(self, new_batch_wait_timeout_s: float) -> None: ...


@serve.deployment(max_ongoing_requests=64)
class TunedModel:
    """One replica: ``factory()`` loaded with the artifact, answering ``POST /`` (tensors in, tensors
    out) and ``GET /`` (what it takes and the batch sizes it was tuned for)."""

    def __init__(
        self,
        factory: Factory | str,
        artifact: str,
        threads: int | None = None,
        load_options: dict[str, Any] | None = None,
        batch_wait_timeout_s: float = 0.005,
        max_body_bytes: int = MAX_BODY_BYTES,
        eager: bool = False,
        batching: bool = True,
    ) -> None:
        self.threads = threads or tuned_threads(artifact) or torch.get_num_threads()
        torch.set_num_threads(self.threads)
        build = resolve_factory(factory)
        model = ait.load(build(), artifact, **(load_options or {}))
        model.eval()
        self.plan = BatchPlan.of(model) if batching else BatchPlan(())
        self.specs = input_specs(model)
        if eager:  # the baseline: the same weights, batching and inputs, none of the tuned backends
            weights = model.state_dict()
            model = build().eval()
            model.load_state_dict(weights)
        self.metrics = Metrics()
        self.runner = BatchRunner(model, self.plan, self.specs, on_call=self.metrics.call)
        self.max_body_bytes = max_body_bytes
        batch_settings = cast(_BatchSettings, self._batched)
        batch_settings.set_max_batch_size(self.plan.max_batch_size)
        batch_settings.set_batch_wait_timeout_s(batch_wait_timeout_s)
        logger.info(
            "serving %s: inputs %s, tuned batch sizes %s, %d threads",
            artifact,
            list(self.specs),
            self.plan.ranges,
            self.threads,
        )

    async def __call__(self, request: Request) -> Response:
        if request.method == "GET":
            return JSONResponse(self.describe())
        arrived = time.perf_counter()
        try:
            if request.method != "POST":
                raise BadRequest(405, f"{request.method} is not served: POST tensors, or GET what this model takes")
            body = await self._body(request)
            content_type = request.headers.get("content-type")
            tensors = decode(body, content_type, self.specs)
            rows = self.runner.rows(tensors)
            answer = await self._batched(_Item(tensors, min(rows, self.plan.max_batch_size), arrived))
            if isinstance(answer, ClientError):  # a BadRequest: this engine's runner answers with one
                raise answer
            accept = request.headers.get("accept")
            payload, kind = encode(answer.outputs, accept if body_format_given(accept) else content_type)
        except BadRequest as bad:
            return JSONResponse({"error": bad.message}, status_code=bad.status)
        except Exception as exc:  # the server's own failure: logged whole, answered without a traceback
            logger.exception("aitune-serve-ray: the request failed")
            return JSONResponse(
                {"error": f"the server failed: {type(exc).__name__}: {exc}; its traceback is in the replica's log"},
                status_code=500,
            )
        return Response(payload, media_type=kind, headers=_headers(answer))

    async def _body(self, request: Request) -> bytes:
        """The body, refused unread when it says it is over the limit."""
        try:
            declared = int(request.headers.get("content-length") or 0)
        except ValueError:
            raise BadRequest(400, "the Content-Length header is not a number") from None
        body = await request.body() if declared <= self.max_body_bytes else b""
        if declared > self.max_body_bytes or len(body) > self.max_body_bytes:
            raise BadRequest(413, f"the body is over {self.max_body_bytes} bytes; send fewer rows per request")
        return body

    @serve.batch(max_batch_size=1, batch_wait_timeout_s=0.005, batch_size_fn=_weight)
    async def _batched(self, items: list[_Item]) -> list[Answer | ClientError]:
        started = time.perf_counter()
        for item in items:
            self.metrics.queued(started - item.arrived)
        return await asyncio.to_thread(self._run, [item.tensors for item in items])

    def _run(self, requests: list[dict[str, torch.Tensor]]) -> list[Answer | ClientError]:
        torch.set_num_threads(self.threads)  # the intra-op budget of this worker thread too
        return self.runner.run(requests)

    def describe(self) -> dict[str, Any]:
        """What the replica takes and how it batches (``GET /``)."""
        return {
            "inputs": {
                s.name: {
                    "dtype": None if s.dtype is None else str(s.dtype).removeprefix("torch."),
                    "rank": s.rank,
                    "batch_axis": s.batch_axis,
                    "required": s.required,
                }
                for s in self.specs.values()
            },
            "tuned_batch_sizes": [list(r) for r in self.plan.ranges],
            "max_batch_size": self.plan.max_batch_size,
            "threads": self.threads,
        }

    def stats(self) -> dict[str, Any]:
        """This replica's metrics so far (what it exports to Ray's metrics, as numbers)."""
        return {**self.describe(), **self.metrics.snapshot(), "pid": os.getpid()}


def body_format_given(accept: str | None) -> bool:
    """Whether ``Accept`` names one of the formats (``*/*`` and none: answer as the request came)."""
    if not accept or accept.split(";")[0].strip() in ("*/*", "application/*"):
        return False
    try:
        body_format(accept)
    except BadRequest:
        return False
    return True


def _headers(answer: Answer) -> dict[str, str]:
    headers = {
        "x-aitune-backend": ", ".join(answer.backends) or "eager (no tuned module ran)",
        "x-aitune-batch-size": ", ".join(map(str, answer.batch_sizes)),
    }
    if answer.eager_reasons:
        headers["x-aitune-eager-reason"] = "; ".join(answer.eager_reasons)
    return {k: _header_text(v) for k, v in headers.items()}


def _header_text(value: str, limit: int = 2000) -> str:
    """One line of printable ASCII (a header's value must be)."""
    text = " ".join(value.split()).encode("ascii", "replace").decode()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def deployment(
    factory: Factory | str,
    artifact: str | Path,
    *,
    replicas: int = 1,
    threads: int | None = None,
    batch_wait_timeout_s: float = 0.005,
    max_ongoing_requests: int = 64,
    ray_actor_options: dict[str, Any] | None = None,
    deployment_options: dict[str, Any] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    expected_sha256: str | None = None,
    trusted_keys: Sequence[str | Path] | None = None,
    signature: str | Path | None = None,
    trust_native_code: bool = False,
    weights: str | None = None,
    fallback: str | None = None,
    eager: bool = False,
    batching: bool = True,
) -> serve.Application:
    """A Ray Serve application serving ``artifact`` loaded into ``factory()`` (``serve.run`` it).

    ``factory`` is a callable or ``"package.module:name"`` that every replica can import; it returns
    the model freshly built, as ``ait.load`` takes it. The trust arguments are ``ait.load``'s: a
    native payload runs only from a pinned, signed or trusted artifact. ``threads`` (default: what
    the artifact was tuned with) is each replica's torch thread count and its Ray CPU request.
    ``artifact`` must be readable at the same path on every node that runs a replica.

    ``deployment_options`` go to Ray Serve's ``Deployment.options`` as they are (``autoscaling_config``,
    ``health_check_period_s``...); with ``autoscaling_config``, ``replicas`` is left to it.

    Baselines for load tests and A/B comparisons: ``eager=True`` serves the factory's model with
    the artifact's weights and batching but none of its tuned backends; ``batching=False`` makes
    each request one model call, as sent.
    """
    path = Path(artifact).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{artifact}: no such artifact")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    options = {
        "expected_sha256": expected_sha256,
        "trusted_keys": [str(Path(k).resolve()) for k in trusted_keys] if trusted_keys else None,
        "signature": str(Path(signature).resolve()) if signature else None,
        "trust_native_code": trust_native_code,
        "weights": weights,
        "fallback": fallback,
    }
    per_replica = threads or tuned_threads(path) or 1
    actor = {"num_cpus": per_replica, **(ray_actor_options or {})}
    chosen = {"ray_actor_options": actor, "max_ongoing_requests": max_ongoing_requests, **(deployment_options or {})}
    if "autoscaling_config" not in chosen:
        chosen["num_replicas"] = replicas
    # TunedModel is a Ray Serve Deployment: mypy keeps a decorated class's own type (python/mypy#3135)
    return TunedModel.options(**chosen).bind(  # type: ignore[attr-defined]
        factory,
        str(path),
        threads,
        {k: v for k, v in options.items() if v not in (None, False)},
        batch_wait_timeout_s,
        max_body_bytes,
        eager,
        batching,
    )
