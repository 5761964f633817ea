"""Running a TensorRT engine on torch tensors, on the current torch CUDA stream.

Every call binds the input tensors' memory and freshly allocated output tensors to the execution
context (``set_tensor_address``) and enqueues the engine (``execute_async_v3``) on the engine's
device, made current for the call, on that device's current stream: no host synchronisation and
no copies on the way out. Profiles are selected once, at construction, on a stream that is
synchronized before the first call. There is one execution context per optimisation profile,
each bound to its profile once, so a call only picks the tightest profile containing its shapes;
input shapes are set only when they change.

**Activation memory.** Every context of the engine is created ``USER_MANAGED``
(``ExecutionContextAllocationStrategy``) and given the same block (``set_device_memory(ptr,
size)``, TensorRT 10.1+; the ``device_memory`` property on 10.0): one torch tensor of
``device_memory_size_v2`` bytes (the most any profile needs), allocated once by torch's caching
allocator when the runner is made. TensorRT allows one block for several contexts when their
executions never overlap (``setDeviceMemoryV2`` in ``NvInferRuntime.h`` rules out only another
context running in parallel on the same memory), and here they do not: a
lock makes each call's binding and enqueue one step, and each call's stream first waits for the
previous call's work (an event), whatever thread or stream it came from. So a context, or a CUDA
graph's context, costs no activation memory of its own, and none is allocated at call time.

**CUDA graphs.** With graphs on, the first call of a shape that fits the graphs' budget gets an
execution context of its own on its profile (TensorRT 10 lets contexts share a profile), copies its
inputs into static buffers, runs the engine once (TensorRT finishes shape-dependent setup then),
captures a graph (``capture_error_mode="thread_local"``: other threads, such as background tuning,
may use CUDA meanwhile) and replays it; later calls of that shape copy inputs in, replay, and copy
outputs out of the graph's buffers (a graph's outputs are overwritten by its next replay, so
handing them out would alias results). Since its context is never set to another shape, shapes
that alternate within one profile keep their graphs; a graph whose context did change shape would
be captured again, never replayed. The graphs kept hold at most ``graph_memory`` bytes of buffers;
a shape that does not fit runs without a graph on its profile's plain context unless it is called
far more often than graphs it could replace (``graphs.GraphCache``), so shapes that cycle do not
capture on every call. A context of a dropped graph serves the next capture on its profile.

Thread safety: the contexts, their bound shapes and addresses, the shared activation memory and the
graphs are shared by all callers, so the lock and the event above keep calls apart on the host and
on the GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from aitune.plugin import BuildError, InputError

from .config import Shape
from .graphs import CapturedGraph, GraphCache, Slot, graph_bytes
from .profiles import ShapeProfile, select_profile

TORCH_DTYPES: dict[str, torch.dtype] = {
    "FLOAT": torch.float32,
    "HALF": torch.float16,
    "BF16": torch.bfloat16,
    "INT8": torch.int8,
    "UINT8": torch.uint8,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "BOOL": torch.bool,
    "FP8": torch.float8_e4m3fn,
}
"""``trt.DataType`` member name -> torch dtype."""


def torch_dtype(trt_dtype_name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[trt_dtype_name]
    except KeyError:
        raise BuildError(
            f"the engine has a tensor of TensorRT type {trt_dtype_name}, which has no torch equivalent here; "
            "keep that tensor inside the model or change its dtype"
        ) from None


SPARE_CONTEXTS = 2
"""Contexts of dropped graphs kept per profile for the next capture (the rest are released)."""
DEFAULT_GRAPH_MEMORY = 1 << 30
"""``TensorRTBackendConfig.cuda_graph_memory``'s default: 1 GiB of graph buffers."""


def device_memory_size(engine: Any) -> int:
    """The activation memory a context of ``engine`` needs, the most over its profiles:
    ``device_memory_size_v2`` (TensorRT 10.1+; 11 has no other), else ``device_memory_size`` (10.0)."""
    size = getattr(engine, "device_memory_size_v2", None)
    return int(engine.device_memory_size if size is None else size)


def set_device_memory(context: Any, address: int, size: int) -> None:
    """Give ``context`` the activation memory at ``address`` (``size`` bytes): ``set_device_memory``
    from TensorRT 10.1, the write-only ``device_memory`` property on 10.0 (deprecated since 10.1)."""
    if hasattr(context, "set_device_memory"):
        context.set_device_memory(address, size)
    else:
        context.device_memory = address


def device_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of device memory from torch's caching allocator (its blocks are 512-byte aligned,
    TensorRT asks for 256)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class EngineRunner:
    """A deserialized engine, its execution contexts and (optionally) its captured CUDA graphs."""

    def __init__(
        self,
        plan: bytes,
        input_names: Sequence[str],
        output_names: Sequence[str],
        profiles: Sequence[ShapeProfile],
        device: torch.device,
        output_dtypes: Sequence[torch.dtype] | None = None,
        use_cuda_graphs: bool = False,
        graph_memory: int = DEFAULT_GRAPH_MEMORY,
        version_compatible: bool = False,
    ) -> None:
        import tensorrt as trt

        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.input_names, self.output_names = list(input_names), list(output_names)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        if version_compatible:  # such a plan embeds its own lean runtime, which must be allowed to run
            self._runtime.engine_host_code_allowed = True
        with torch.cuda.device(self.device):
            self.engine = self._runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise BuildError("TensorRT could not deserialize the plan (see the TensorRT log above)")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        if sorted(names) != sorted(self.input_names + self.output_names):
            raise BuildError(
                f"the engine's tensors {names} are not the expected {self.input_names + self.output_names}"
            )
        shape_io = [n for n in names if self.engine.is_shape_inference_io(n)]
        if shape_io:
            raise BuildError(f"the engine takes shape tensors {shape_io} on the host, which this backend does not bind")
        self._in_dtypes = [torch_dtype(self.engine.get_tensor_dtype(n).name) for n in self.input_names]
        self._engine_out_dtypes = [torch_dtype(self.engine.get_tensor_dtype(n).name) for n in self.output_names]
        self._out_dtypes = list(output_dtypes) if output_dtypes is not None else self._engine_out_dtypes

        n_profiles = self.engine.num_optimization_profiles
        self.profiles = list(profiles) if n_profiles == len(profiles) else list(profiles)[:1]
        if n_profiles != len(self.profiles):
            raise BuildError(f"the engine has {n_profiles} optimisation profiles, its metadata {len(profiles)}")
        self._strategy = getattr(trt, "ExecutionContextAllocationStrategy", None)
        self._memory: torch.Tensor | None = None
        """The activation memory every context shares (None: each context allocates its own)."""
        self._memory_streams: set[int] = set()
        with torch.cuda.device(self.device):
            if self._strategy is not None:
                self._memory = self._allocate(device_memory_size(self.engine))
            contexts = [self._create_context(i) for i in range(n_profiles)]
        if any(c is None for c in contexts):
            raise BuildError("TensorRT could not create an execution context (out of GPU memory?)")
        self._slots = [Slot(c) for c in contexts]
        """Each profile's plain context: calls without graphs, and the shape queries before a capture."""
        self._spare: dict[int, list[Slot]] = {}
        """Per profile, contexts of dropped graphs that the next capture takes."""
        self._selected: dict[tuple[Shape, ...], int] = {}
        self.use_cuda_graphs, self.graph_memory = use_cuda_graphs, graph_memory
        self._graphs = GraphCache(graph_memory)
        self.captures = 0
        self.ungraphed_calls = 0
        """Calls in graph mode that ran without a graph (their shape did not earn a place in the budget)."""
        self._lock = threading.Lock()
        with torch.cuda.device(self.device):
            self._done = torch.cuda.Event()  # recorded after each call's work

    def _allocate(self, size: int) -> torch.Tensor:
        try:
            return device_buffer(max(size, 1), self.device)
        except torch.cuda.OutOfMemoryError as exc:
            raise BuildError(
                f"the engine's activation memory ({size / 2**20:.1f} MiB, shared by all its execution contexts) "
                f"could not be allocated on {self.device}: {exc}"
            ) from exc

    @property
    def device_memory_bytes(self) -> int:
        """Bytes of the activation memory all contexts share; 0 when each context allocates its own."""
        return 0 if self._memory is None else self._memory.numel()

    def _create_context(self, profile: int) -> Any:
        """A new execution context on ``profile`` (None when TensorRT cannot make one), on the
        shared activation memory. The profile switch is enqueued on a stream of its own and finished
        before returning (TensorRT requires that before any enqueue on another stream, and calls
        enqueue on the caller's); the memory is given after it, as trtexec does, so the switch
        touches none of the memory another call may be using."""
        if self._memory is not None:
            assert self._strategy is not None
            context = self.engine.create_execution_context(self._strategy.USER_MANAGED)
        else:
            context = self.engine.create_execution_context()
        if context is None:
            return None
        if profile:
            setup = torch.cuda.Stream(self.device)
            if not context.set_optimization_profile_async(profile, setup.cuda_stream):
                raise BuildError(f"TensorRT refused to select optimisation profile {profile}")
            setup.synchronize()
        if self._memory is not None:
            set_device_memory(context, self._memory.data_ptr(), self._memory.numel())
        return context

    # -- per call ---------------------------------------------------------------------------

    def run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with self._lock:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self._done)  # the previous call, perhaps on another thread's stream
            if self._memory is not None and stream.cuda_stream not in self._memory_streams:
                # the shared memory is used on this stream too: torch must not reuse it, when the
                # runner goes, before this stream's work is done
                self._memory.record_stream(stream)
                self._memory_streams.add(stream.cuda_stream)
            outputs = self._run(tensors)
            self._done.record(stream)
        return outputs

    def _run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        shapes = tuple(tuple(t.shape) for t in tensors)
        index = self._selected.get(shapes)
        if index is None:
            index = select_profile(self.profiles, shapes)
            if index is None:
                raise InputError(
                    f"no optimisation profile of this TensorRT engine contains the input shapes {list(shapes)}; "
                    "add a TensorRTProfile covering them and tune again"
                )
            self._selected[shapes] = index
        inputs = [self._prepare(t, dtype) for t, dtype in zip(tensors, self._in_dtypes)]
        with torch.cuda.device(self.device):  # TensorRT enqueues on the current device: make it the engine's
            if self.use_cuda_graphs:
                outputs = self._replay(index, shapes, inputs)
            else:
                outputs = self._plain(index, shapes, inputs)
        return [o if o.dtype == want else o.to(want) for o, want in zip(outputs, self._out_dtypes)]

    def _prepare(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if t.device != self.device:
            raise InputError(f"a TensorRT engine on {self.device} got an input on {t.device}; move the inputs there")
        if t.dtype != dtype:
            t = t.to(dtype)
        return t.contiguous()

    def _plain(self, index: int, shapes: tuple[Shape, ...], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One enqueue on the profile's plain context, on the caller's stream."""
        outputs = self._bind(self._slots[index], shapes, inputs)
        self._execute(self._slots[index], torch.cuda.current_stream(self.device).cuda_stream)
        return outputs

    def _set_shapes(self, slot: Slot, shapes: tuple[Shape, ...]) -> list[Shape]:
        """Set ``slot``'s input shapes (when they change); the output shapes TensorRT infers."""
        context = slot.context
        if slot.bound != shapes:
            for name, shape in zip(self.input_names, shapes):
                if not context.set_input_shape(name, shape):
                    raise InputError(f"TensorRT refused the shape {shape} for input {name!r}")
            out_shapes = [tuple(context.get_tensor_shape(n)) for n in self.output_names]
            if any(d < 0 for s in out_shapes for d in s):
                raise BuildError(
                    f"output shapes {out_shapes} depend on the input values (data-dependent shapes), which this "
                    "backend does not support; keep such ops (nonzero, unique...) outside the tuned module"
                )
            slot.bound, slot.out_shapes = shapes, out_shapes
            slot.bindings += 1
        return slot.out_shapes

    def _bind(self, slot: Slot, shapes: tuple[Shape, ...], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out_shapes = self._set_shapes(slot, shapes)
        context = slot.context
        for name, t in zip(self.input_names, inputs):
            context.set_tensor_address(name, t.data_ptr())
        outputs = [
            torch.empty(shape, dtype=dtype, device=self.device)
            for shape, dtype in zip(out_shapes, self._engine_out_dtypes)
        ]
        for name, t in zip(self.output_names, outputs):
            context.set_tensor_address(name, t.data_ptr())
        return outputs

    def _execute(self, slot: Slot, stream: int) -> None:
        if not slot.context.execute_async_v3(stream):
            raise RuntimeError("TensorRT failed to enqueue the engine (see the TensorRT log above)")

    # -- CUDA graphs ------------------------------------------------------------------------

    def _replay(self, index: int, shapes: tuple[Shape, ...], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        key = (index, shapes)
        count = self._graphs.record(key)
        entry = self._graphs.current(key)
        if entry is None:
            # a shape without a graph is reconsidered each time its count doubles (1, 2, 4, 8...), so
            # running it without one costs no look at the kept graphs on most calls
            entry = self._admit(index, shapes, inputs) if count & (count - 1) == 0 else None
            if entry is None:
                self.ungraphed_calls += 1
                return self._plain(index, shapes, inputs)
            self._graphs.add(key, entry)
        else:
            for static, t in zip(entry.inputs, inputs):
                static.copy_(t)
        entry.graph.replay()
        return [o.clone() for o in entry.outputs]

    def _admit(self, index: int, shapes: tuple[Shape, ...], inputs: Sequence[torch.Tensor]) -> CapturedGraph | None:
        """The captured graph of a shape that has none, or None when it runs without one: it does not
        earn a place in the budget, or TensorRT cannot make a context for it."""
        out_shapes = self._set_shapes(self._slots[index], shapes)  # the plain context says the output shapes
        buffers = sum(t.numel() * t.element_size() for t in inputs) + sum(
            _numel(shape) * dtype.itemsize for shape, dtype in zip(out_shapes, self._engine_out_dtypes)
        )
        nbytes = graph_bytes(buffers)
        victims = self._graphs.room_for((index, shapes), nbytes)
        if victims is None:
            return None
        if victims:
            # their last replays must be done before their buffers go back to torch's allocator
            torch.cuda.current_stream(self.device).synchronize()
            for key in victims:
                self._release(key[0], self._graphs.drop(key).slot)  # type: ignore[index]
        slot = self._graph_slot(index)
        if slot is None:
            return None
        return self._capture(slot, shapes, inputs, nbytes)

    def _graph_slot(self, index: int) -> Slot | None:
        """A context on profile ``index`` for one graph: a dropped graph's, else a new one (None when
        TensorRT cannot make one; with shared activation memory that is rare)."""
        spare = self._spare.get(index)
        if spare:
            return spare.pop()
        context = self._create_context(index)
        return None if context is None else Slot(context)

    def _release(self, index: int, slot: Slot) -> None:
        spare = self._spare.setdefault(index, [])
        if len(spare) < SPARE_CONTEXTS:
            spare.append(slot)

    def _capture(
        self, slot: Slot, shapes: tuple[Shape, ...], inputs: Sequence[torch.Tensor], nbytes: int
    ) -> CapturedGraph:
        static_inputs = [t.clone() for t in inputs]
        outputs = self._bind(slot, shapes, static_inputs)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            self._execute(slot, side.cuda_stream)  # TensorRT finishes shape-dependent setup before capture
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                self._execute(slot, side.cuda_stream)
        current.wait_stream(side)
        self.captures += 1
        return CapturedGraph(graph, static_inputs, outputs, slot, slot.bindings, nbytes)

    @property
    def cached_graphs(self) -> list[tuple[Shape, ...]]:
        """Input shapes of the captured graphs kept now, least recently used first."""
        return [key[1] for key in self._graphs.kept()]  # type: ignore[index]

    @property
    def kept_graph_bytes(self) -> int:
        """What the kept graphs count for against ``graph_memory``."""
        return self._graphs.used_bytes

    @property
    def recaptures(self) -> int:
        """Captures of a shape whose graph had gone stale (its context was set to another shape since)."""
        return self._graphs.recaptures


def _numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
