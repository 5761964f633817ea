"""The runner: an exported graph opened by ONNX Runtime and run on the caller's tensors.

On CPU, inputs go to ONNX Runtime as numpy views of the torch tensors (no copy) and outputs come
back as torch tensors sharing ONNX Runtime's arrays. On CUDA and TensorRT, IO binding hands ONNX
Runtime the torch tensors' device pointers and binds outputs to preallocated torch tensors. An
output's shape comes from the ONNX model's dims when they are named after input dims, else from
the first call with the same input shapes (that one call lets ONNX Runtime allocate the outputs
and waits for them; every later call of those shapes is preallocated). ONNX Runtime runs on a
stream of its own (``user_compute_stream``) ordered after the caller's stream and before it by
CUDA events, with its end-of-run synchronisation off: no host synchronisation per call.
"""

from __future__ import annotations

import collections
import copy
import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy
import torch

from aitune.plugin import BackendUnavailableError, BuildError, GraphSpec, machine_cores

from .config import ONNXExecutionProvider, ONNXRuntimeBackendConfig
from .placement import RECORD_KEY, cpu_compute_from_assignment, fallback_error, read_profile, records_assignment
from .plugin import preload_tensorrt

MAX_KNOWN_SHAPES = 256
"""Input shapes whose output shapes are remembered (least recently used dropped first)."""

_TORCH_FROM_ORT = {
    "tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(double)": torch.float64,
    "tensor(int64)": torch.int64, "tensor(int32)": torch.int32, "tensor(int16)": torch.int16,
    "tensor(int8)": torch.int8, "tensor(uint8)": torch.uint8, "tensor(bool)": torch.bool,
}  # fmt: skip

CPU_DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)
"""ONNX Runtime graph rewrites the CPU provider's sessions run without. ``SkipLayerNormFusion``
turns ``Add`` (residual) + ``LayerNormalization`` into ``com.microsoft.SkipLayerNormalization``,
whose fp32 CPU kernel (in ONNX Runtime's source: a scalar loop per row, a division per element)
took about five times what the ``Add`` and ``LayerNormalization`` it replaces took in onnxruntime
1.32: on a dynamo export of BERT (the TorchScript exports tried were not fused by it) the graph ran
4-26% slower with it, at batch 1 and 8, hidden 128 to 768 (benchmarks/README.md, "ONNX Runtime:
aitune's call against its own graph by hand"). The CUDA and TensorRT providers' sessions keep it
(another kernel, not measured)."""

_SHARED_ON_COPY = frozenset({"inference", "stream", "run_options"})
"""What a deep copy shares with the original: ONNX Runtime objects, which cannot be copied."""


class ORTRunner:
    """One exported graph run by ONNX Runtime on one provider and device: the ``InferenceSession``
    (``inference``), its stream, run options and IO binding, the thread budget, and the check of where
    its nodes run. It notes what it chose (threads, providers, placement, IO binding) in ``notes``,
    the backend's ``build_info``."""

    def __init__(
        self,
        config: ONNXRuntimeBackendConfig,
        graph: GraphSpec,
        device: torch.device,
        provider: ONNXExecutionProvider,
        cache_dir: Path,
        input_names: tuple[str, ...],
        output_names: tuple[str, ...],
        notes: dict[str, Any],
    ) -> None:
        self.config = config
        self.graph = graph
        self.device = device
        self.provider = provider
        self.cache_dir = cache_dir
        self.input_names = input_names
        self.output_names = output_names
        self.notes = notes
        self.inference: Any = None
        """ONNX Runtime's ``InferenceSession`` on the graph; None until :meth:`open`."""
        self.outputs: list[tuple[torch.dtype | None, list[int | str | None] | None]] = []
        self.bound = False
        """Whether runs use IO binding (a GPU provider with ``use_io_binding``)."""
        self.stream: Any = None
        self.run_options: Any = None
        self.out_shapes: collections.OrderedDict[tuple[tuple[int, ...], ...], list[tuple[int, ...]]] = (
            collections.OrderedDict()
        )
        self.profiling = False
        """Runs are profiled until the first one shows where the nodes ran (ONNX Runtime < 1.24)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> ORTRunner:
        """ONNX Runtime's objects (and the buffers, stream and run options they hold) cannot be
        copied or pickled: the copy shares them, which is safe because the weights are read-only,
        ``run`` may be called from several threads, and a refit opens the graph anew in the copy."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = value if key in _SHARED_ON_COPY else copy.deepcopy(value, memo)
        return new

    def open(
        self,
        model: Path,
        files: Sequence[str],
        *,
        optimized_to: Path | None = None,
        preoptimized: bool = False,
        profile_to: Path | None = None,
    ) -> None:
        """ONNX Runtime on ``model`` (``files``: it and its external data). On a GPU provider, where its
        nodes run is checked: here when ONNX Runtime records the assignment, else (``profile_to``, at
        build) on the profile of the first run. What ran before stays until this succeeds."""
        import onnxruntime as ort

        provider, device, config = self.provider, self.device, self.config
        options = ort.SessionOptions()
        level = "disabled" if preoptimized else config.graph_optimization_level
        options.graph_optimization_level = {
            "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[level]
        # one thread budget for every candidate: torch's, unless the config names its own (0: ORT's default)
        # a count from the config (perhaps read from a file) is capped at the cores this process may use
        intra, inter = config.intra_op_num_threads, config.inter_op_num_threads
        cores = machine_cores()
        options.intra_op_num_threads = torch.get_num_threads() if intra is None else min(intra, cores)
        options.inter_op_num_threads = 1 if inter is None else min(inter, cores)  # execution is sequential
        self.notes["threads"] = options.intra_op_num_threads or "onnxruntime's default"
        options.log_severity_level = 3
        record = provider is not ONNXExecutionProvider.CPU and records_assignment(ort.InferenceSession)
        for key, value in config_entries(provider, record).items():
            options.add_session_config_entry(key, value)
        profiling = provider is not ONNXExecutionProvider.CPU and not record and profile_to is not None
        if profiling:
            options.enable_profiling = True
            options.profile_file_prefix = str(profile_to)
        if optimized_to is not None:
            options.optimized_model_filepath = str(optimized_to)
        disabled = disabled_optimizers(provider) if not preoptimized else ()
        available = ort.get_available_providers()
        if provider.ort_name not in available:
            raise BackendUnavailableError(
                f"this onnxruntime build has no {provider.ort_name} (it has {available}); install onnxruntime-gpu "
                "for CUDA and TensorRT, or use execution_provider=ONNXExecutionProvider.CPU"
            )
        names = self.input_names or _graph_input_names(model)
        stream = None
        if provider is not ONNXExecutionProvider.CPU:
            if provider is ONNXExecutionProvider.TENSORRT:
                try:
                    preload_tensorrt()  # pip's TensorRT is off the loader's path the provider searches
                except OSError as exc:
                    raise BackendUnavailableError(f"the {provider.ort_name} cannot run here: {exc}") from exc
            stream = torch.cuda.Stream(device)
        chain = provider_chain(
            provider,
            device.index or 0,
            self.graph,
            names,
            config.provider_options,
            self.cache_dir,
            stream=stream.cuda_stream if stream is not None else None,
            model_digest=model_digest(model, files) if provider is ONNXExecutionProvider.TENSORRT else "",
        )
        try:
            extra = {"disabled_optimizers": list(disabled)} if disabled else {}
            inference = ort.InferenceSession(str(model), options, providers=chain, **extra)
        except Exception as exc:
            raise BuildError(
                f"ONNX Runtime could not create a session with the {provider.ort_name}: {exc}; check "
                "provider_options, or try another graph_optimization_level or exporter"
            ) from exc
        if provider.ort_name not in inference.get_providers():
            raise BuildError(
                f"ONNX Runtime silently fell back to {inference.get_providers()} instead of the {provider.ort_name} "
                "(its libraries failed to load: check that the CUDA, cuDNN and TensorRT versions match the "
                "installed onnxruntime-gpu), so this would not measure what was asked for"
            )
        if record:
            error = fallback_error(
                cpu_compute_from_assignment(inference.get_provider_graph_assignment_info()),
                provider.ort_name,
                "by the session's graph assignment",
            )
            if error:
                raise BuildError(error)
            self.notes["placement"] = "no compute node on the CPU (the session's graph assignment)"
        self.profiling = profiling
        self.inference = inference
        self.bound = provider is not ONNXExecutionProvider.CPU and config.use_io_binding
        self.stream, self.out_shapes = stream, collections.OrderedDict()
        self.run_options = ort.RunOptions()
        if stream is not None:  # ordering against the caller's stream is done with CUDA events instead
            self.run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        self.outputs = [(_TORCH_FROM_ORT.get(o.type), _dims(o.shape)) for o in inference.get_outputs()]
        self.notes.update(provider=provider.value, session_providers=inference.get_providers(), io_binding=self.bound)
        if disabled:
            self.notes["disabled_optimizers"] = list(disabled)

    def check_profiled_placement(self) -> None:
        """End the profile of the first run and fail the build if it ran compute nodes on the CPU."""
        self.profiling = False
        path = self.inference.end_profiling()  # also stops profiling: later runs are not recorded
        if not path:
            raise BuildError("ONNX Runtime wrote no profile of the first run, so where its nodes ran is unknown")
        error = fallback_error(read_profile(path), self.provider.ort_name, "in the profile of the first run")
        if error:
            raise BuildError(error)
        self.notes["placement"] = "no compute node on the CPU (the profile of the first run)"

    # -- run ------------------------------------------------------------------------------------

    def run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The graph's flat outputs for its flat inputs."""
        return self._run_bound(tensors) if self.bound else self._run_host(tensors)

    def _run_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        arrays = self.run_arrays([host_array(t) for t in tensors])
        if self.device.type == "cpu":
            return [torch.from_numpy(a) for a in arrays]
        return [torch.from_numpy(a).to(self.device) for a in arrays]

    def run_arrays(self, arrays: Sequence[Any]) -> list[Any]:
        """The graph's flat outputs (numpy arrays) for its flat inputs as host numpy arrays (a
        C-contiguous copy of one that is not): :meth:`_run_host` without a torch tensor on either side."""
        feed = {
            name: a if a.flags.c_contiguous else numpy.ascontiguousarray(a) for name, a in zip(self.input_names, arrays)
        }
        return list(self.inference.run(self.output_names, feed))

    def _run_bound(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        binding = self.inference.io_binding()
        device_id = self.device.index or 0
        caller, stream = torch.cuda.current_stream(self.device), self.stream
        kept, sizes = [], {}
        for t, spec in zip(tensors, self.graph.inputs):
            t = t.detach().to(self.device).contiguous()  # a copy, if any, is queued on the caller's stream
            kept.append(t)
            sizes.update({dim: t.shape[axis] for axis, dim in enumerate(spec.dims) if dim is not None})
        stream.wait_stream(caller)  # after the copies: ONNX Runtime reads the inputs only once they landed
        for name, t in zip(self.input_names, kept):
            t.record_stream(stream)  # ONNX Runtime reads it on its stream: not reused before that is done
            binding.bind_input(name, "cuda", device_id, _numpy_dtype(t.dtype), tuple(t.shape), t.data_ptr())
        key = tuple(tuple(t.shape) for t in kept)
        known = self.out_shapes.get(key)
        if known is not None:
            self.out_shapes.move_to_end(key)
        shapes: Sequence[tuple[int, ...] | None] = known or [resolve_shape(dims, sizes) for _, dims in self.outputs]
        outs: list[torch.Tensor | None] = []
        for name, (dtype, _), shape in zip(self.output_names, self.outputs, shapes):
            if shape is None or dtype is None:
                binding.bind_output(name, "cuda", device_id)
                outs.append(None)
                continue
            out = torch.empty(shape, dtype=dtype, device=self.device)
            binding.bind_output(name, "cuda", device_id, _numpy_dtype(dtype), shape, out.data_ptr())
            outs.append(out)
        self.inference.run_with_iobinding(binding, self.run_options)
        if any(o is None for o in outs):  # first call of these shapes: ONNX Runtime allocated some outputs
            stream.synchronize()
            values = binding.get_outputs()
            outs = [o if o is not None else _from_ort(values[i], self.device) for i, o in enumerate(outs)]
            self.out_shapes[key] = [tuple(o.shape) for o in outs]  # type: ignore[union-attr]
            while len(self.out_shapes) > MAX_KNOWN_SHAPES:
                self.out_shapes.popitem(last=False)
        caller.wait_stream(stream)  # the caller's later work sees the outputs
        return outs  # type: ignore[return-value]


# -- pure helpers (tested on CPU) ---------------------------------------------------------------


def provider_chain(
    provider: ONNXExecutionProvider,
    device_id: int,
    graph: GraphSpec,
    input_names: Sequence[str],
    options: Mapping[str, str],
    cache_dir: Path,
    stream: int | None = None,
    model_digest: str = "",
) -> list[tuple[str, dict[str, str]]]:
    """The ``providers`` list for ONNX Runtime: the asked-for provider first, its fallbacks after.

    For TensorRT, the graph's min/opt/max shapes become the engine's optimisation profile and
    engines are cached under aitune's cache folder, so a load does not rebuild them. The provider's
    cache key hashes names, not weights, so each payload's engines get a prefix of their own from
    ``model_digest`` (a refit's copy holds the new weights, so its digest differs): neither a fine-tune nor a refit
    reuses the engine of the old weights. CUDA runs fp32 as fp32
    (``use_tf32`` off, unless the options say otherwise), so fp32's bound holds. ``stream`` (a CUDA
    stream handle) is the stream the GPU providers run on.
    """
    cpu: tuple[str, dict[str, str]] = ("CPUExecutionProvider", {})
    if provider is ONNXExecutionProvider.CPU:
        return [("CPUExecutionProvider", dict(options))]
    on_stream = {"user_compute_stream": str(stream)} if stream is not None else {}  # implies has_user_compute_stream
    cuda = ("CUDAExecutionProvider", {"device_id": str(device_id), "use_tf32": "0", **on_stream})
    if provider is ONNXExecutionProvider.CUDA:
        return [("CUDAExecutionProvider", {**cuda[1], **options}), cpu]
    trt = {
        "device_id": str(device_id),
        **on_stream,
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(Path(cache_dir) / "onnxruntime-tensorrt"),
        "trt_engine_cache_prefix": f"aitune_{model_digest[:16]}" if model_digest else "aitune",
        **tensorrt_profile(graph, input_names),
        **options,
    }
    return [("TensorrtExecutionProvider", trt), cuda, cpu]


def disabled_optimizers(provider: ONNXExecutionProvider) -> tuple[str, ...]:
    """The graph rewrites a session on ``provider`` runs without (see :data:`CPU_DISABLED_OPTIMIZERS`)."""
    return CPU_DISABLED_OPTIMIZERS if provider is ONNXExecutionProvider.CPU else ()


def config_entries(provider: ONNXExecutionProvider, record_assignment: bool) -> dict[str, str]:
    """ONNX Runtime's session config entries. A GPU provider may leave nodes to the CPU provider (the
    CUDA provider keeps shape arithmetic there on purpose), so ``session.disable_cpu_ep_fallback`` is
    never set: it refuses such graphs, and refuses any session that lists the CPU provider. Instead
    the placement is recorded, where ONNX Runtime can, and checked for compute nodes (``placement``)."""
    if provider is ONNXExecutionProvider.CPU or not record_assignment:
        return {}
    return {RECORD_KEY: "1"}


def model_digest(model: Path, files: Sequence[str]) -> str:
    """SHA-256 of the graph and the external-data files beside it: what its TensorRT engine is of
    (a refit opens a copy with the new weights written in, so its digest is the new weights')."""
    digest = hashlib.sha256()
    for path in [model, *(model.parent / f for f in files if f != model.name)]:
        if path.is_file():
            with open(path, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
    return digest.hexdigest()


def tensorrt_profile(graph: GraphSpec, input_names: Sequence[str]) -> dict[str, str]:
    """TensorRT provider options giving every input's min/opt/max shape (``x:1x16,mask:1x5``)."""
    if not any(spec.dynamic_axes for spec in graph.inputs):
        return {}
    out = {}
    for which in ("min", "opt", "max"):
        out[f"trt_profile_{which}_shapes"] = ",".join(
            f"{name}:{'x'.join(str(s) for s in graph.shape_at(spec, which))}"
            for name, spec in zip(input_names, graph.inputs)
            if spec.rank
        )
    return out


def resolve_shape(dims: Sequence[int | str | None] | None, sizes: Mapping[str, int]) -> tuple[int, ...] | None:
    """An output's shape from its ONNX dims and the sizes the call gave the named dims, if it follows."""
    if dims is None:
        return None
    shape = []
    for d in dims:
        if isinstance(d, int):
            shape.append(d)
        elif isinstance(d, str) and d in sizes:
            shape.append(sizes[d])
        else:
            return None
    return tuple(shape)


def _dims(shape: Any) -> list[int | str | None] | None:
    if shape is None:
        return None
    return [d if isinstance(d, (int, str)) else None for d in shape]


def _graph_input_names(model: Path) -> tuple[str, ...]:
    import onnx

    return tuple(v.name for v in onnx.load(str(model), load_external_data=False).graph.input)


def host_array(t: torch.Tensor) -> Any:
    """``t`` as a C-contiguous numpy array on the host, a view where it can be one.

    A host tensor as it usually comes (no grad) is handed over by ``.numpy()`` alone, and its layout
    checked on the numpy side: on a served model's path each torch call finds its caches cold and
    costs microseconds (three attribute reads and ``numpy()``, against one call here)."""
    try:
        array = t.numpy()  # raises for a tensor that needs grad, off the host, or conjugated
    except (RuntimeError, TypeError):
        return numpy_of(t)
    return array if array.flags.c_contiguous else numpy.ascontiguousarray(array)


def numpy_of(t: torch.Tensor) -> Any:
    """``t`` as a numpy array on the host (a view where it already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().numpy()


def _numpy_dtype(dtype: torch.dtype) -> Any:
    return torch.empty((), dtype=dtype).numpy().dtype


def _from_ort(value: Any, device: torch.device) -> torch.Tensor:
    """An output ONNX Runtime allocated, as a torch tensor: by DLPack where the build exports it, else
    through the host. Only the first call of new input shapes gets here (its output shapes are then known)."""
    to_dlpack = getattr(getattr(value, "_ortvalue", None), "to_dlpack", None)
    if to_dlpack is not None:
        return torch.from_dlpack(to_dlpack())
    return torch.from_numpy(value.numpy()).to(device)
