"""Running a TensorRT engine on torch tensors, on the current torch CUDA stream.

Every call binds the input tensors' memory and freshly allocated output tensors to the execution
context (``set_tensor_address``) and enqueues the engine (``execute_async_v3``) on the engine's
device, made current for the call, on that device's current stream: no host synchronisation and
no copies on the way out. Profiles are selected once, at construction, on a stream that is
synchronized before the first call. There is one execution
context per optimisation profile, each bound to its profile once, so a call only picks the
tightest profile containing its shapes; input shapes are set only when they change.

With CUDA graphs on, the first call of each shape gets an execution context of its own on its
profile (TensorRT 10 lets contexts share a profile), copies its inputs into static buffers, runs
the engine once (TensorRT finishes shape-dependent setup then), captures a graph
(``capture_error_mode="thread_local"``: other threads, such as background tuning, may use CUDA
meanwhile) and replays it; later calls of that shape copy inputs in, replay, and copy outputs out
of the graph's buffers (a graph's outputs are overwritten by its next replay, so handing them out
would alias results). Since its context is never set to another shape, shapes that alternate
within one profile keep their graphs; a graph whose context did change shape would be captured
again, never replayed (``graphs.GraphCache``). Each context holds its own activation memory: at
most ``max_graphs`` graphs and their contexts are kept, least recently used first, and one more is
dropped when TensorRT cannot create a context.

Thread safety: the contexts, their bound shapes and addresses and the graphs are shared, so a
lock makes each call's binding and enqueue one step, and a call on another stream first waits for
the previous call's work (an event), since two enqueues of one context must not overlap on the GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from aitune.plugin import BuildError, InputError

from .config import Shape
from .graphs import CapturedGraph, GraphCache, Slot
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
        max_graphs: int = 8,
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
        with torch.cuda.device(self.device):
            contexts = [self._create_context(i) for i in range(n_profiles)]
        if any(c is None for c in contexts):
            raise BuildError("TensorRT could not create an execution context (out of GPU memory?)")
        self._slots = [Slot(c) for c in contexts]
        self._claimed: set[int] = set()
        """Profiles whose own context a graph has taken (with graphs on, calls use no other)."""
        self._selected: dict[tuple[Shape, ...], int] = {}
        self.use_cuda_graphs, self.max_graphs = use_cuda_graphs, max_graphs
        self._graphs = GraphCache(max_graphs)
        self.captures = 0
        self._lock = threading.Lock()
        with torch.cuda.device(self.device):
            self._done = torch.cuda.Event()  # recorded after each call's work

    def _create_context(self, profile: int) -> Any:
        """A new execution context on ``profile`` (None when TensorRT cannot allocate one). The
        profile switch is enqueued on a stream of its own and finished before returning: TensorRT
        requires that before any enqueue on another stream, and calls enqueue on the caller's."""
        if self._strategy is not None and self.engine.num_optimization_profiles > 1:
            context = self.engine.create_execution_context(self._strategy.ON_PROFILE_CHANGE)
        else:
            context = self.engine.create_execution_context()
        if context is not None and profile:
            setup = torch.cuda.Stream(self.device)
            if not context.set_optimization_profile_async(profile, setup.cuda_stream):
                raise BuildError(f"TensorRT refused to select optimisation profile {profile}")
            setup.synchronize()
        return context

    # -- per call ---------------------------------------------------------------------------

    def run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with self._lock:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self._done)  # the previous call, perhaps on another thread's stream
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
                outputs = self._bind(self._slots[index], shapes, inputs)
                self._execute(self._slots[index], torch.cuda.current_stream(self.device).cuda_stream)
        return [o if o.dtype == want else o.to(want) for o, want in zip(outputs, self._out_dtypes)]

    def _prepare(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if t.device != self.device:
            raise InputError(f"a TensorRT engine on {self.device} got an input on {t.device}; move the inputs there")
        if t.dtype != dtype:
            t = t.to(dtype)
        return t.contiguous()

    def _bind(self, slot: Slot, shapes: tuple[Shape, ...], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
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
        for name, t in zip(self.input_names, inputs):
            context.set_tensor_address(name, t.data_ptr())
        outputs = [
            torch.empty(shape, dtype=dtype, device=self.device)
            for shape, dtype in zip(slot.out_shapes, self._engine_out_dtypes)
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
        entry = self._graphs.current(key)
        if entry is None:
            entry = self._capture(index, shapes, inputs)
            if self._graphs.add(key, entry):
                torch.cuda.current_stream(self.device).synchronize()  # a dropped graph's last replay is done
        else:
            for static, t in zip(entry.inputs, inputs):
                static.copy_(t)
        entry.graph.replay()
        return [o.clone() for o in entry.outputs]

    def _graph_slot(self, index: int) -> Slot:
        """A context on profile ``index`` for one graph: the profile's own the first time, then a new
        one, dropping kept graphs while TensorRT cannot allocate it."""
        if index not in self._claimed:
            self._claimed.add(index)
            return self._slots[index]
        context = self._create_context(index)
        while context is None and self._graphs.kept():
            torch.cuda.current_stream(self.device).synchronize()
            self._graphs.drop_oldest()
            context = self._create_context(index)
        if context is None:
            raise RuntimeError("TensorRT could not create an execution context for a CUDA graph (out of GPU memory?)")
        return Slot(context)

    def _capture(self, index: int, shapes: tuple[Shape, ...], inputs: Sequence[torch.Tensor]) -> CapturedGraph:
        slot = self._graph_slot(index)
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
        return CapturedGraph(graph, static_inputs, outputs, slot, slot.bindings)

    @property
    def cached_graphs(self) -> list[tuple[Shape, ...]]:
        """Input shapes of the captured graphs kept now, least recently used first."""
        return [key[1] for key in self._graphs.kept()]  # type: ignore[index]

    @property
    def recaptures(self) -> int:
        """Captures of a shape whose graph had gone stale (its context was set to another shape since)."""
        return self._graphs.recaptures
