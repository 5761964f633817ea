"""aitune's batcher on its own (no server, no kserve): no wait when the model is idle, what queued
while it ran joins the next call within the tuned sizes, and one bad request fails alone."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from aitune.torch.serving import BatchPlan, BatchRunner, ClientError, InputSpec
from aitune_serve_kserve.batching import Batcher, Stopping


class Recording(torch.nn.Module):
    """Doubles its input; records each call's rows; the first call waits until released."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []
        self.release = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.calls:
            self.release.wait(10)
        self.calls.append(x.shape[0])
        if x.shape[1] == 3:
            raise ValueError("three features are not taken")
        return x * 2


def _batcher(model: Recording) -> Batcher:
    plan = BatchPlan(((2, 4),))
    return Batcher(BatchRunner(model, plan, {"x": InputSpec("x", True, torch.float32, (-1, -1), 0)}))


def test_an_idle_model_runs_a_request_at_once_and_what_queued_meanwhile_joins_one_call():
    model = Recording()
    batcher = _batcher(model)

    async def scenario() -> list[torch.Tensor]:
        first = asyncio.ensure_future(batcher.submit({"x": torch.ones(1, 2)}))
        await asyncio.sleep(0.2)  # the first call is running (held): these three queue meanwhile
        rest = [asyncio.ensure_future(batcher.submit({"x": torch.full((1, 2), float(i))})) for i in range(3)]
        await asyncio.sleep(0.1)
        model.release.set()
        return [a.outputs["output"] for a in await asyncio.gather(first, *rest)]

    try:
        answers = asyncio.run(scenario())
    finally:
        batcher.close()
    # alone, padded to the smallest tuned size 2; then the three that queued, in one call of 3 rows
    assert model.calls == [2, 3]
    assert [a.tolist() for a in answers] == [[[2.0, 2.0]], [[0.0, 0.0]], [[2.0, 2.0]], [[4.0, 4.0]]]


def test_rows_above_the_largest_tuned_size_wait_for_the_next_call():
    model = Recording()
    model.release.set()
    runner = BatchRunner(model, BatchPlan(((2, 4),)), {"x": InputSpec("x", True, torch.float32, (-1, -1), 0)})
    answers = runner.run([{"x": torch.ones(3, 2)}, {"x": torch.ones(3, 2)}])
    assert model.calls == [4, 2]  # 6 rows: a call of 4, then 2; never past the tuned 4
    assert [a.outputs["output"].shape[0] for a in answers if not isinstance(a, ClientError)] == [3, 3]


def test_a_request_the_model_refuses_is_the_servers_error_when_it_fits_what_was_tuned():
    model = Recording()
    model.release.set()
    batcher = _batcher(model)

    async def scenario() -> None:
        await batcher.submit({"x": torch.ones(2, 3)})

    try:
        with pytest.raises(ValueError, match="three features"):
            asyncio.run(scenario())
    finally:
        batcher.close()


def test_closing_answers_what_is_queued_and_running_and_takes_nothing_new():
    """kserve unloads the model as it starts stopping while gRPC still drains: nothing held is dropped."""
    model = Recording()
    batcher = _batcher(model)

    async def scenario() -> list[torch.Tensor]:
        running = asyncio.ensure_future(batcher.submit({"x": torch.ones(1, 2)}))
        await asyncio.sleep(0.2)
        queued = asyncio.ensure_future(batcher.submit({"x": torch.ones(2, 2)}))
        await asyncio.sleep(0.05)
        batcher.close()
        with pytest.raises(Stopping):
            await batcher.submit({"x": torch.ones(1, 2)})
        model.release.set()
        return [a.outputs["output"] for a in await asyncio.gather(running, queued)]

    answers = asyncio.run(scenario())
    assert [tuple(a.shape) for a in answers] == [(1, 2), (2, 2)] and model.calls == [2, 2]
