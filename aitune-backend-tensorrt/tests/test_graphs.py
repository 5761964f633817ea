"""CUDA graphs on CPU: the replay policy (``graphs.GraphCache``) and the order of the runner's calls
around a capture, with fakes of TensorRT's execution contexts and of torch's CUDA graph objects."""

from __future__ import annotations

import contextlib
import types

import torch

from aitune_backend_tensorrt.graphs import CapturedGraph, GraphCache, Slot
from aitune_backend_tensorrt.runtime import EngineRunner


def _entry(slot: Slot, name: str) -> CapturedGraph:
    return CapturedGraph(name, [], [], slot, slot.bindings)


def test_a_graph_whose_context_was_set_to_another_shape_is_recaptured_not_replayed():
    cache, slot = GraphCache(8), Slot(context=None, bindings=1)
    cache.add((0, (4,)), _entry(slot, "A"))
    assert cache.current((0, (4,))).graph == "A"
    slot.bindings += 1  # the context was set to another shape since the capture
    assert cache.current((0, (4,))) is None and cache.recaptures == 1
    assert cache.kept() == []


def test_at_most_max_graphs_are_kept_least_recently_used_out_first():
    cache = GraphCache(2)
    slots = [Slot(context=i, bindings=1) for i in range(3)]
    assert cache.add((0, (1,)), _entry(slots[0], "1")) == []
    cache.add((0, (2,)), _entry(slots[1], "2"))
    cache.current((0, (1,)))
    dropped = cache.add((0, (3,)), _entry(slots[2], "3"))
    assert [d.graph for d in dropped] == ["2"], "the dropped graph (and its context) goes"
    assert cache.kept() == [(0, (1,)), (0, (3,))]
    assert cache.drop_oldest() and cache.kept() == [(0, (3,))]


class _Context:
    """TensorRT's execution context as the runner uses it, logging each call."""

    def __init__(self, log: list[str], number: int) -> None:
        self.log, self.number, self.shapes = log, number, {}

    def set_input_shape(self, name, shape):
        self.log.append(f"context {self.number}: shape {name}={shape}")
        self.shapes[name] = shape
        return True

    def get_tensor_shape(self, name):
        return self.shapes["x"]

    def set_tensor_address(self, name, address):
        pass

    def execute_async_v3(self, stream):
        self.log.append(f"context {self.number}: enqueue{' (captured)' if _Cuda.capturing else ''}")
        return True


class _Cuda:
    """torch.cuda's stream, graph and capture objects, logging what the runner does with them."""

    capturing = False

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def stream(self, device=None):
        return types.SimpleNamespace(cuda_stream=1, wait_stream=lambda other: None, synchronize=lambda: None)

    def graph_class(self):
        log = self.log
        return type("CUDAGraph", (), {"replay": lambda g: log.append("replay")})

    @contextlib.contextmanager
    def capture(self, graph, stream=None, capture_error_mode="global"):
        self.log.append(f"capture ({capture_error_mode})")
        _Cuda.capturing = True
        try:
            yield
        finally:
            _Cuda.capturing = False


def _runner(monkeypatch, log: list[str]) -> EngineRunner:
    cuda = _Cuda(log)
    monkeypatch.setattr(torch.cuda, "Stream", cuda.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", cuda.graph_class())
    monkeypatch.setattr(torch.cuda, "graph", cuda.capture)
    created = []

    def create_execution_context(*strategy):
        created.append(_Context(log, len(created)))
        log.append(f"new context {created[-1].number}")
        return created[-1]

    runner = EngineRunner.__new__(EngineRunner)
    runner.device = torch.device("cpu")  # the fakes stand for the CUDA calls; tensors stay on the host
    runner.engine = types.SimpleNamespace(
        num_optimization_profiles=1, create_execution_context=create_execution_context
    )
    runner._strategy = None
    runner.input_names, runner.output_names = ["x"], ["y"]
    runner._engine_out_dtypes = [torch.float32]
    runner._graphs = GraphCache(8)
    runner.captures = 0
    runner._slots, runner._claimed = [Slot(create_execution_context())], set()  # the profile's own, made at load
    return runner


def test_shapes_alternating_within_one_profile_keep_their_graphs(monkeypatch):
    """A-B-A-B in one profile: each shape is captured once on a context of its own, then replayed."""
    log: list[str] = []
    runner = _runner(monkeypatch, log)
    for batch in (2, 4, 2, 4, 2):
        runner._replay(0, ((batch, 3),), [torch.zeros(batch, 3)])
    assert runner.captures == 2 and runner.recaptures == 0
    assert log[:6] == [
        "new context 0",
        "context 0: shape x=(2, 3)",
        "context 0: enqueue",  # the warm-up, before capture: TensorRT finishes its shape setup
        "capture (thread_local)",
        "context 0: enqueue (captured)",
        "replay",
    ]
    assert log[6:12] == [
        "new context 1",
        "context 1: shape x=(4, 3)",
        "context 1: enqueue",
        "capture (thread_local)",
        "context 1: enqueue (captured)",
        "replay",
    ]
    assert log[12:] == ["replay", "replay", "replay"], "no shape set again, nothing captured again"


def test_when_tensorrt_cannot_create_a_context_the_oldest_graph_makes_room(monkeypatch):
    log: list[str] = []
    runner = _runner(monkeypatch, log)
    runner._replay(0, ((2, 3),), [torch.zeros(2, 3)])  # on the profile's own context
    runner._replay(0, ((3, 3),), [torch.zeros(3, 3)])
    create = runner.engine.create_execution_context
    calls = []

    def out_of_memory_once(*strategy):
        calls.append(1)
        return None if len(calls) == 1 else create(*strategy)

    runner.engine.create_execution_context = out_of_memory_once
    runner._replay(0, ((4, 3),), [torch.zeros(4, 3)])
    assert runner.cached_graphs == [((3, 3),), ((4, 3),)], "the oldest graph was dropped for the new context"


def test_the_backend_declares_tf32_as_configured():
    from aitune_backend_tensorrt import TensorRTBackend, TensorRTBackendConfig

    assert TensorRTBackend(TensorRTBackendConfig()).computes_tf32(), "TensorRT's TF32 flag is on by default"
    assert not TensorRTBackend(TensorRTBackendConfig(tf32=False)).computes_tf32()
