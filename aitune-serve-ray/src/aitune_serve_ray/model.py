"""What runs inside a replica: the kserve engine's model (:class:`aitune_serve_kserve.TunedModel`:
load, warm-up, metadata from the tuned graphs, the request checked against the tuned inputs, the
response with its ``aitune_*`` parameters), its calls queued by Ray Serve's ``serve.batch`` instead
of the kserve engine's queue and observed by Ray Serve's metrics.

Imported by the deployment in each replica only: kserve is not imported where the application is
built (a driver, ``serve build``), so a process that also holds Triton's gRPC client (whose protocol
buffers share kserve's names) can build and call the application.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import attrs
import torch
from ray import serve

from aitune.torch.serving import Answer, BatchPlan, BatchRunner, ClientError, Factory, Request
from aitune_serve_kserve.batching import Batcher
from aitune_serve_kserve.model import TunedModel as ProtocolModel

from .metrics import Metrics
from .replica import BATCH_WAIT_S


@attrs.frozen
class _Item:
    """One checked request waiting for its batch."""

    request: Request
    weight: int
    """Its rows, counted at most up to the batch's size in rows (a larger request is split by the runner)."""
    arrived: float


def _weight(items: Sequence[_Item]) -> int:
    return sum(item.weight for item in items)


class _BatchSettings(Protocol):
    """What a ``@serve.batch`` method offers besides its call (Ray documents both setters; its type
    hints give the decorated method only its call)."""

    def set_max_batch_size(self, new_max_batch_size: int) -> None: ...

    def set_batch_wait_timeout_s(self, new_batch_wait_timeout_s: float) -> None: ...


class ServeBatcher(Batcher):
    """The kserve engine's queue, replaced by Ray Serve's own ``serve.batch``: a request waits up to
    ``wait_s`` for others, the batch holds up to ``max_batch_size`` rows, and one worker thread runs
    the runner on it (one batch at a time, with the replica's torch threads).

    ``serve.batch`` keeps one queue per decorated method in a process: one replica serves one model.
    """

    def __init__(
        self, runner: BatchRunner, *, max_batch_size: int, wait_s: float, threads: int, metrics: Metrics
    ) -> None:
        super().__init__(runner)
        self.max_batch_size = max_batch_size
        self.threads = threads
        self.metrics = metrics
        settings = cast(_BatchSettings, self._batched)
        settings.set_max_batch_size(max_batch_size)
        settings.set_batch_wait_timeout_s(wait_s)

    async def submit(self, request: Request) -> Answer:
        """This request's answer, computed in a batch Ray Serve formed (raises :class:`ClientError`)."""
        weight = min(self.runner.rows(request), self.max_batch_size)
        answer = await self._batched(_Item(request, weight, time.perf_counter()))
        if isinstance(answer, ClientError):
            raise answer
        return answer

    @serve.batch(max_batch_size=1, batch_wait_timeout_s=0.0, batch_size_fn=_weight)  # set per replica
    async def _batched(self, items: list[_Item]) -> list[Answer | ClientError]:
        started = time.perf_counter()
        for item in items:
            self.metrics.queued(started - item.arrived)
        answers = await asyncio.to_thread(self._run, [item.request for item in items])
        self._answered()  # what the model's health check reads, as with kserve's queue
        return answers

    def _run(self, requests: list[Request]) -> list[Answer | ClientError]:
        torch.set_num_threads(self.threads)  # the intra-op budget of this worker thread too
        return self.runner.run(requests)


class ReplicaModel(ProtocolModel):
    """The kserve engine's model (load and warm-up, metadata, request checks, response), its calls
    queued by Ray Serve's ``serve.batch`` and observed by Ray Serve's metrics.

    ``max_batch_size`` is a batch's size in rows (default: the largest tuned batch size; a larger one
    is cut into calls of tuned sizes); ``batching=False`` makes each request one model call, as sent
    (the baseline a load test compares against). ``pad`` (input name -> pad value) adds to the
    padding the artifact declares, so that requests of different lengths join one call.
    """

    def __init__(
        self,
        name: str,
        factory: Factory | str,
        artifact: str | Path,
        *,
        load_options: Any = None,
        threads: int | None = None,
        eager: bool = False,
        max_rows: int | None = None,
        pad: Mapping[str, float] | None = None,
        max_batch_size: int | None = None,
        batch_wait_timeout_s: float = BATCH_WAIT_S,
        batching: bool = True,
    ) -> None:
        super().__init__(
            name,
            factory,
            artifact,
            load_options=load_options,
            threads=threads,
            eager=eager,
            max_rows=max_rows,
            pad=pad,
        )
        self.max_batch_size = max_batch_size
        self.batch_wait_timeout_s = batch_wait_timeout_s
        self.batching = batching
        self.metrics = Metrics()

    def _load(self) -> None:
        super()._load()  # built, loaded, warmed up through the kserve engine's queue
        assert self.batcher is not None
        runner = self.batcher.runner
        self.batcher.close()
        runner.on_call = self.metrics.call
        if not self.batching:
            runner.plan = BatchPlan(())
        self.batcher = ServeBatcher(
            runner,
            max_batch_size=self.max_batch_size or runner.plan.max_batch_size,
            wait_s=self.batch_wait_timeout_s,
            threads=self.threads,
            metrics=self.metrics,
        )
