"""CUDA graphs and activation memory on CPU: the replay policy (``graphs.GraphCache``), and the order of
the runner's calls around contexts, shared memory and captures, with fakes of TensorRT's engine and
execution contexts and of torch's CUDA stream, event and graph objects."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch

from aitune.errors import ConfigError
from aitune_backend_tensorrt import runtime
from aitune_backend_tensorrt.graphs import AGE_EVERY, GRAPH_FLOOR_BYTES, CapturedGraph, GraphCache, Slot
from aitune_backend_tensorrt.profiles import ShapeProfile
from aitune_backend_tensorrt.runtime import EngineRunner

MiB = 1 << 20


def _entry(slot: Slot, name: str, nbytes: int = GRAPH_FLOOR_BYTES) -> CapturedGraph:
    return CapturedGraph(name, [], [], slot, slot.bindings, nbytes)


def test_a_graph_whose_context_was_set_to_another_shape_is_recaptured_not_replayed():
    cache, slot = GraphCache(8 * MiB), Slot(context=None, bindings=1)
    cache.add((0, (4,)), _entry(slot, "A"))
    assert cache.current((0, (4,))).graph == "A"
    slot.bindings += 1  # the context was set to another shape since the capture
    assert cache.current((0, (4,))) is None and cache.recaptures == 1
    assert cache.kept() == []


def test_the_bound_is_in_bytes_and_a_graph_larger_than_it_never_gets_captured():
    cache = GraphCache(10 * MiB)
    cache.record("a")
    assert cache.room_for("a", 4 * MiB) == []
    cache.add("a", _entry(Slot(None), "a", 4 * MiB))
    cache.record("b")
    assert cache.room_for("b", 6 * MiB) == [], "4 + 6 MiB fit in 10"
    cache.add("b", _entry(Slot(None), "b", 6 * MiB))
    assert cache.used_bytes == 10 * MiB
    cache.record("c")
    assert cache.room_for("c", 11 * MiB) is None, "over the whole budget: never captured, however hot"


def test_a_graph_is_dropped_only_for_a_shape_called_more_than_twice_as_often():
    cache = GraphCache(2 * MiB)
    for key in ("a", "b"):
        cache.record(key)
        cache.add(key, _entry(Slot(None), key))
    cache.record("a")  # a: 2 calls, b: 1
    cache.record("c")
    assert cache.room_for("c", MiB) is None, "c (1 call) is not hotter than b (1 call)"
    cache.record("c")
    assert cache.room_for("c", MiB) is None, "2 calls are not more than twice 1"
    cache.record("c")
    assert cache.room_for("c", MiB) == ["b"], "3 calls beat b's 1: the least called graph goes, not a's"
    assert cache.room_for("c", 2 * MiB) is None, "a (2 calls) is not cold enough to go as well"


def test_counts_halve_as_calls_go_by_and_forgotten_shapes_leave_no_count():
    cache = GraphCache(MiB)
    cache.record("kept")
    cache.add("kept", _entry(Slot(None), "kept"))
    for _ in range(9):
        cache.record("hot")
    cache.record("once")
    for _ in range(AGE_EVERY - 11):
        cache.record("filler")
    assert cache.count("hot") == 4 and cache.count("kept") == 0 and cache.count("once") == 0
    assert "once" not in cache._counts and "kept" in cache._counts, "a kept graph's key stays, at 0"


# -- the runner, with TensorRT and CUDA faked -------------------------------------------------


class _Context:
    """TensorRT's execution context as the runner uses it, logging each call."""

    def __init__(self, log: list[str], number: int, v2: bool = True) -> None:
        self.log, self.number, self.shapes = log, number, {}
        if v2:
            self.set_device_memory = self._set_device_memory

    def _set_device_memory(self, address, size):
        self.log.append(f"context {self.number}: memory {address:#x} {size}")

    def __setattr__(self, name, value):
        if name == "device_memory":  # TensorRT 10.0's write-only property
            self.log.append(f"context {self.number}: memory {value:#x} (property)")
        object.__setattr__(self, name, value)

    def set_optimization_profile_async(self, profile, stream):
        self.log.append(f"context {self.number}: profile {profile}")
        return True

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
    """torch.cuda's stream, event, graph and capture objects, logging what the runner does with them."""

    capturing = False

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def stream(self, device=None):
        return types.SimpleNamespace(
            cuda_stream=1,
            wait_stream=lambda other: None,
            wait_event=lambda event: None,
            synchronize=lambda: self.log.append("synchronize"),
        )

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


class _Engine:
    """A deserialized engine: one input ``x``, one output ``y``, fp32, on ``profiles`` profiles."""

    def __init__(self, log: list[str], profiles: int = 1, v2: bool = True, memory: int = 3000) -> None:
        self.log, self.num_optimization_profiles, self.v2 = log, profiles, v2
        self.num_io_tensors, self.contexts = 2, []
        if v2:
            self.device_memory_size_v2 = memory
        else:
            self.device_memory_size = memory
        self.fail_next = 0

    def get_tensor_name(self, i):
        return ["x", "y"][i]

    def is_shape_inference_io(self, name):
        return False

    def get_tensor_dtype(self, name):
        return types.SimpleNamespace(name="FLOAT")

    def create_execution_context(self, *strategy):
        if self.fail_next:
            self.fail_next -= 1
            self.log.append("no context")
            return None
        context = _Context(self.log, len(self.contexts), self.v2)
        self.contexts.append(context)
        self.log.append(f"new context {context.number} ({strategy[0] if strategy else 'STATIC'})")
        return context


def _fake_tensorrt(engine: _Engine) -> types.SimpleNamespace:
    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, plan):
            return engine

    return types.SimpleNamespace(
        Logger=type("Logger", (), {"WARNING": 0, "__init__": lambda self, level: None}),
        Runtime=Runtime,
        ExecutionContextAllocationStrategy=types.SimpleNamespace(
            STATIC="STATIC", ON_PROFILE_CHANGE="ON_PROFILE_CHANGE", USER_MANAGED="USER_MANAGED"
        ),
    )


def _runner(monkeypatch, log: list[str], graph_memory: int = 8 * MiB, profiles: int = 1, **engine) -> EngineRunner:
    """The real constructor over the fakes; tensors then stay on the host."""
    cuda = _Cuda(log)
    monkeypatch.setattr(torch.cuda, "Stream", cuda.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", lambda: types.SimpleNamespace(record=lambda stream: None))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", cuda.graph_class())
    monkeypatch.setattr(torch.cuda, "graph", cuda.capture)
    allocations = []

    def device_buffer(nbytes, device):
        allocations.append(nbytes)
        log.append(f"allocate {nbytes}")
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(runtime, "device_buffer", device_buffer)
    fake = _Engine(log, profiles, **engine)
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt(fake))
    profile = ShapeProfile((((1, 3), (4, 3), (64, 3)),))
    runner = EngineRunner(
        b"plan", ["x"], ["y"], [profile] * profiles, torch.device("cuda", 0),
        use_cuda_graphs=True, graph_memory=graph_memory,
    )  # fmt: skip
    runner.device = torch.device("cpu")  # the fakes stand for the CUDA calls; tensors stay on the host
    runner.allocations = allocations
    return runner


def _memory(runner: EngineRunner) -> str:
    return f"{runner._memory.data_ptr():#x}"


def test_every_context_of_an_engine_shares_one_allocation_of_activation_memory(monkeypatch):
    """USER_MANAGED contexts, one block of device_memory_size_v2 bytes, given to each after its profile."""
    log: list[str] = []
    runner = _runner(monkeypatch, log, profiles=2, memory=3000)
    assert runner.allocations == [3000] and runner.device_memory_bytes == 3000
    address = _memory(runner)
    assert log == [
        "allocate 3000",
        "new context 0 (USER_MANAGED)",
        f"context 0: memory {address} 3000",
        "new context 1 (USER_MANAGED)",
        "context 1: profile 1",  # the profile switch first, finished on its own stream, then the memory
        "synchronize",
        f"context 1: memory {address} 3000",
    ]
    log.clear()
    for batch in (2, 4, 8):
        runner._replay(1, ((batch, 3),), [torch.zeros(batch, 3)])
    made = [line for line in log if line.startswith(("new context", "allocate"))]
    assert made == ["new context 2 (USER_MANAGED)", "new context 3 (USER_MANAGED)", "new context 4 (USER_MANAGED)"]
    assert [line for line in log if "memory" in line] == [f"context {n}: memory {address} 3000" for n in (2, 3, 4)]
    assert runner.allocations == [3000], "a graph's context allocates no activation memory of its own"


def test_tensorrt_10_0_gets_the_same_memory_through_its_property(monkeypatch):
    """10.0 has neither device_memory_size_v2 nor set_device_memory (both from 10.1)."""
    log: list[str] = []
    runner = _runner(monkeypatch, log, v2=False, memory=512)
    assert runner.allocations == [512]
    assert log[1:] == ["new context 0 (USER_MANAGED)", f"context 0: memory {_memory(runner)} (property)"]


def test_an_engine_that_needs_no_activation_memory_still_gets_a_valid_block(monkeypatch):
    log: list[str] = []
    runner = _runner(monkeypatch, log, memory=0)
    assert runner.allocations == [1] and log[2] == f"context 0: memory {_memory(runner)} 1"


def test_shapes_alternating_within_one_profile_keep_their_graphs(monkeypatch):
    """A-B-A-B in one profile: each shape is captured once on a context of its own, then replayed."""
    log: list[str] = []
    runner = _runner(monkeypatch, log)
    log.clear()
    for batch in (2, 4, 2, 4, 2):
        runner._replay(0, ((batch, 3),), [torch.zeros(batch, 3)])
    assert runner.captures == 2 and runner.recaptures == 0 and runner.ungraphed_calls == 0
    memory = f"context 1: memory {_memory(runner)} 3000"
    assert log[:8] == [
        "context 0: shape x=(2, 3)",  # the plain context says the output shapes (the graph's size)
        "new context 1 (USER_MANAGED)",
        memory,
        "context 1: shape x=(2, 3)",
        "context 1: enqueue",  # the warm-up, before capture: TensorRT finishes its shape setup
        "capture (thread_local)",
        "context 1: enqueue (captured)",
        "replay",
    ]
    assert log[8:10] == ["context 0: shape x=(4, 3)", "new context 2 (USER_MANAGED)"]
    assert log[-3:] == ["replay", "replay", "replay"], "no shape set again, nothing captured again"
    assert runner.kept_graph_bytes == 2 * GRAPH_FLOOR_BYTES, "tiny graphs count for the floor each"


def test_shapes_cycling_past_the_budget_keep_the_first_graphs_and_run_the_rest_without_capture(monkeypatch):
    """Room for two graphs, four shapes in a cycle: two captures in all, no capture storm."""
    log: list[str] = []
    runner = _runner(monkeypatch, log, graph_memory=2 * GRAPH_FLOOR_BYTES)
    asked = []
    room_for = runner._graphs.room_for
    monkeypatch.setattr(runner._graphs, "room_for", lambda key, nbytes: asked.append(key) or room_for(key, nbytes))
    for _ in range(50):
        for batch in (2, 3, 4, 5):
            runner._replay(0, ((batch, 3),), [torch.zeros(batch, 3)])
    assert runner.captures == 2 and runner.cached_graphs == [((2, 3),), ((3, 3),)]
    assert runner.ungraphed_calls == 100 and log.count("replay") == 100
    assert log.count("synchronize") == 0, "nothing was dropped, so nothing waited"
    assert log.count("context 0: enqueue") == 100, "the other shapes ran as plain enqueues on the profile's context"
    assert len(asked) == 2 + 2 * 6, "a shape without a graph is reconsidered at 1, 2, 4, 8, 16 and 32 calls only"


def test_a_shape_that_becomes_hot_takes_the_place_of_the_coldest_graph_once(monkeypatch):
    log: list[str] = []
    runner = _runner(monkeypatch, log, graph_memory=2 * GRAPH_FLOOR_BYTES)
    for batch in (2, 3):
        runner._replay(0, ((batch, 3),), [torch.zeros(batch, 3)])
    runner._replay(0, ((2, 3),), [torch.zeros(2, 3)])  # 2 called twice, 3 once
    for _ in range(10):
        runner._replay(0, ((8, 3),), [torch.zeros(8, 3)])
    assert runner.captures == 3 and runner.cached_graphs == [((2, 3),), ((8, 3),)]
    assert runner.ungraphed_calls == 3, "8 ran without a graph until its count (asked at 1, 2, 4) beat twice 3's"
    assert log.count("synchronize") == 1, "the dropped graph's replays were waited for once"
    assert len(runner.engine.contexts) == 3, "8's graph took the context 3's graph left"


def test_when_tensorrt_cannot_make_a_context_the_call_runs_without_a_graph(monkeypatch):
    log: list[str] = []
    runner = _runner(monkeypatch, log)
    runner.engine.fail_next = 1
    out = runner._replay(0, ((2, 3),), [torch.zeros(2, 3)])
    assert out[0].shape == (2, 3) and runner.captures == 0 and runner.ungraphed_calls == 1
    runner._replay(0, ((2, 3),), [torch.zeros(2, 3)])
    assert runner.captures == 1, "the next call of that shape tries again"


def test_the_graphs_bound_is_a_number_of_bytes():
    from aitune_backend_tensorrt import TensorRTBackendConfig

    assert TensorRTBackendConfig().cuda_graph_memory == 1 << 30
    assert TensorRTBackendConfig(cuda_graph_memory=256 * MiB).cuda_graph_memory == 256 * MiB
    for bad in (-1, 1.5, True, "1G"):
        with pytest.raises(ConfigError, match="cuda_graph_memory is a number of bytes"):
            TensorRTBackendConfig(cuda_graph_memory=bad)
    with pytest.raises(TypeError):
        TensorRTBackendConfig(max_cuda_graphs=8)  # the count it replaces


def test_the_backend_declares_tf32_as_configured():
    from aitune_backend_tensorrt import TensorRTBackend, TensorRTBackendConfig

    assert TensorRTBackend(TensorRTBackendConfig()).computes_tf32(), "TensorRT's TF32 flag is on by default"
    assert not TensorRTBackend(TensorRTBackendConfig(tf32=False)).computes_tf32()
