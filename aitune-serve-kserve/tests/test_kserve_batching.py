"""aitune's batcher on its own (no server, no kserve): no wait when the model is idle, what queued
while it ran joins the next call within the tuned sizes, and one bad request fails alone."""

from __future__ import annotations

import asyncio
import threading
import types
from pathlib import Path

import pytest
import torch

from aitune.torch.serving import BatchPlan, BatchRunner, ClientError, InputSpec
from aitune_serve_kserve.batching import Batcher, Stopping, request_company


class Recording(torch.nn.Module):
    """Doubles its input; records each call's rows; the first call waits until released."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []
        self.threads: list[str] = []
        self.release = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.calls:
            self.release.wait(10)
        self.calls.append(x.shape[0])
        self.threads.append(threading.current_thread().name)
        if x.shape[1] == 3:
            raise ValueError("three features are not taken")
        return x * 2


def _batcher(model: Recording) -> Batcher:
    plan = BatchPlan(((2, 4),))
    return Batcher(BatchRunner(model, plan, {"x": InputSpec("x", True, torch.float32, (-1, -1), 0)}))


def test_a_lone_request_runs_at_once_on_the_event_loop():
    """Nobody else waits: no queue, no hop to the model's thread (padded to the smallest tuned size 2)."""
    model = Recording()
    model.release.set()
    batcher = _batcher(model)

    async def scenario() -> torch.Tensor:
        return (await batcher.submit({"x": torch.ones(1, 2)})).outputs["output"]

    try:
        answer = asyncio.run(scenario())
    finally:
        batcher.close()
    assert model.calls == [2] and model.threads == [threading.main_thread().name]
    assert answer.tolist() == [[2.0, 2.0]]


@pytest.mark.parametrize("company", [None, True, False])
def test_a_request_yields_to_the_loop_before_deciding_unless_the_server_says_it_is_alone(company):
    """Another task that is ready gets its turn before the lone request's call, so a request that arrived
    with it can join; a server that knows no other request is in progress skips that yield."""
    model = Recording()
    model.release.set()
    batcher = _batcher(model)
    if company is not None:
        batcher.company = lambda: company
    order: list[str] = []

    async def scenario() -> None:
        asyncio.get_running_loop().call_soon(order.append, "other task")
        await batcher.submit({"x": torch.ones(1, 2)})
        order.append("answered")
        await asyncio.sleep(0)

    try:
        asyncio.run(scenario())
    finally:
        batcher.close()
    assert model.calls == [2]
    expected = ["answered", "other task"] if company is False else ["other task", "answered"]
    assert order == expected


def test_the_server_knows_whether_other_requests_are_in_progress_from_uvicorns_request_tasks():
    """``aitune serve`` gives each batcher a view of uvicorn's set of request tasks (that of the uvicorn
    server kserve's REST server keeps as ``_server``), and none with gRPC on: that set does not hold
    gRPC requests."""
    import importlib.util

    import uvicorn

    # kserve's RESTServer, read rather than imported (kserve's gRPC protos clash with those of
    # tritonclient.grpc, which other tests import, in one process): it keeps its uvicorn server as _server
    spec = importlib.util.find_spec("kserve")  # a top-level package's spec imports nothing
    assert spec is not None and spec.submodule_search_locations
    source = Path(next(iter(spec.submodule_search_locations)), "protocol", "rest", "server.py").read_text()
    assert "self._server = _RefreshingServer(self.config)" in source
    rest_server = types.SimpleNamespace(_server=uvicorn.Server(uvicorn.Config(app=None)))
    assert request_company(rest_server, grpc=True) is None
    assert request_company(types.SimpleNamespace(), grpc=False) is None  # unknown: the batcher assumes company
    company = request_company(rest_server, grpc=False)
    assert company is not None and not company()
    rest_server._server.server_state.tasks.add("this request")
    assert not company()
    rest_server._server.server_state.tasks.add("another")
    assert company()


def test_requests_that_come_together_or_while_a_call_runs_join_one_call():
    model = Recording()
    batcher = _batcher(model)

    async def scenario() -> list[torch.Tensor]:
        # two together: neither runs alone, so they go to the model's thread, whose first call is held
        first = [asyncio.ensure_future(batcher.submit({"x": torch.ones(1, 2)})) for _ in range(2)]
        await asyncio.sleep(0.2)  # the first call is running (held): these three queue meanwhile
        rest = [asyncio.ensure_future(batcher.submit({"x": torch.full((1, 2), float(i))})) for i in range(3)]
        await asyncio.sleep(0.1)
        model.release.set()
        return [a.outputs["output"] for a in await asyncio.gather(*first, *rest)]

    try:
        answers = asyncio.run(scenario())
    finally:
        batcher.close()
    assert model.calls == [2, 3]
    assert all(name.startswith("aitune-model") for name in model.threads)
    assert [a.tolist() for a in answers] == [[[2.0, 2.0]], [[2.0, 2.0]], [[0.0, 0.0]], [[2.0, 2.0]], [[4.0, 4.0]]]


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
        held = asyncio.ensure_future(batcher.submit({"x": torch.ones(1, 2)}))  # two: the model's thread runs them
        await asyncio.sleep(0.2)
        queued = asyncio.ensure_future(batcher.submit({"x": torch.ones(2, 2)}))
        await asyncio.sleep(0.05)
        batcher.close()
        with pytest.raises(Stopping):
            await batcher.submit({"x": torch.ones(1, 2)})
        model.release.set()
        return [a.outputs["output"] for a in await asyncio.gather(running, held, queued)]

    answers = asyncio.run(scenario())
    assert [tuple(a.shape) for a in answers] == [(1, 2), (1, 2), (2, 2)] and model.calls == [2, 2]


def test_a_slow_model_runs_even_a_lone_request_in_its_own_thread(monkeypatch):
    """Once a call took INLINE_MAX_S or longer, the loop keeps reading requests while the model runs."""
    from aitune_serve_kserve import batching

    model = Recording()
    model.release.set()
    batcher = _batcher(model)

    async def scenario() -> None:
        await batcher.submit({"x": torch.ones(1, 2)})  # the first: inline, and it is timed
        monkeypatch.setattr(batching, "INLINE_MAX_S", 0.0)  # from now on every call counts as slow
        await batcher.submit({"x": torch.ones(1, 2)})

    try:
        asyncio.run(scenario())
    finally:
        batcher.close()
    assert model.threads[0] == threading.main_thread().name
    assert model.threads[1].startswith("aitune-model")


def test_health_is_cheap_probes_an_idle_model_in_the_background_and_is_false_while_stopping(monkeypatch):
    """What the readiness probes read (``TunedModel.healthy``, which kserve also asks before every
    request): never a wait; an idle model is sent its start-up request in the background, and a
    failure of that call reads not healthy until a call succeeds again."""
    from aitune_serve_kserve import batching

    model = Recording()
    model.release.set()
    batcher = _batcher(model)
    probe = {"x": torch.ones(1, 2)}

    async def scenario() -> list[bool]:
        said = [batcher.healthy(probe)]  # idle since start: healthy until told otherwise, a probe sent
        await batcher._probe_task
        said.append(batcher.healthy(probe))  # it just answered: nothing sent
        monkeypatch.setattr(batching, "HEALTH_CALL_AFTER_S", 0.0)
        said.append(batcher.healthy({"x": torch.ones(1, 3)}))  # this probe makes the model raise
        await batcher._probe_task
        monkeypatch.setattr(batching, "HEALTH_CALL_AFTER_S", 3600.0)
        said.append(batcher.healthy(probe))  # the failure reads
        await batcher.submit(probe)  # a call that succeeds
        said.append(batcher.healthy(probe))
        return said

    try:
        said = asyncio.run(scenario())
        assert said == [True, True, True, False, True]
        assert model.calls == [2, 2, 2] and "three features are not taken" in batcher.unhealthy_reason
        batcher.close()
        assert not batcher.healthy(probe) and batcher.unhealthy_reason == "the server is stopping"
    finally:
        batcher.close()
