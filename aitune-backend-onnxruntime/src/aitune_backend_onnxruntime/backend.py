"""ONNXRuntimeBackend: the module exported to ONNX and run by an ONNX Runtime session.

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
import contextlib
import copy
import hashlib
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from aitune.plugin import (
    MODEL_FILE,
    Backend,
    BackendUnavailableError,
    BuildContext,
    BuildError,
    GraphSpec,
    LoadContext,
    NotApplicableError,
    ONNXExport,
    ONNXExportConfig,
    SerializationError,
    Tolerance,
    export_onnx,
    machine_cores,
    model_files,
    payload_file,
    tree,
)

from .config import INT8_TOLERANCE, TF32_TOLERANCE, ONNXExecutionProvider, ONNXRuntimeBackendConfig
from .exports import shared_export
from .placement import RECORD_KEY, cpu_compute_from_assignment, fallback_error, read_profile, records_assignment
from .plugin import preload_tensorrt, provider_unavailable

OPTIMIZED_FILE = "model.optimized.onnx"
INT8_FILE = "model.int8.onnx"
UNSUPPORTED_DTYPES = ("bfloat16", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")
MAX_KNOWN_SHAPES = 256
"""Input shapes whose output shapes are remembered (least recently used dropped first)."""

_TORCH_FROM_ORT = {
    "tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(double)": torch.float64,
    "tensor(int64)": torch.int64, "tensor(int32)": torch.int32, "tensor(int16)": torch.int16,
    "tensor(int8)": torch.int8, "tensor(uint8)": torch.uint8, "tensor(bool)": torch.bool,
}  # fmt: skip


_SHARED_ON_COPY = frozenset({"_session", "_stream", "_run_options", "_initializers"})
"""What a deep copy shares with the original: ONNX Runtime objects, which cannot be copied."""


class ONNXRuntimeBackend(Backend):
    """ONNX export run by ONNX Runtime (CPU, CUDA or TensorRT execution provider)."""

    name = "onnxruntime"
    config_class = ONNXRuntimeBackendConfig
    config: ONNXRuntimeBackendConfig
    builds_static = True  # a dim whose range is one size is exported static (aitune.onnx_export)

    def __init__(self, config: ONNXRuntimeBackendConfig | None = None) -> None:
        super().__init__(config)
        self._session: Any = None
        self._graph: GraphSpec | None = None
        self._device = torch.device("cpu")
        self._structure: dict[str, Any] = {}
        self._input_names: tuple[str, ...] = ()
        self._output_names: tuple[str, ...] = ()
        self._outputs: list[tuple[torch.dtype | None, list[int | str | None] | None]] = []
        self._bound = False
        self._stream: Any = None
        self._run_options: Any = None
        self._out_shapes: collections.OrderedDict[tuple[tuple[int, ...], ...], list[tuple[int, ...]]] = (
            collections.OrderedDict()
        )
        self._files: list[str] = []
        self._optimized: list[str] = []
        self._model = MODEL_FILE
        self._meta: dict[str, Any] = {}
        self._dir: Path | None = None
        self._provider = ONNXExecutionProvider.CPU
        self._cache_dir = Path(tempfile.gettempdir())
        self._initializers: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
        self._refit_plan: dict[str, tuple[str, bool]] = {}
        """Per initializer of the exported graph, the module weight it holds and whether transposed."""
        self._profiling = False
        """The session profiles its runs until the first one shows where the nodes ran (ONNX Runtime < 1.24)."""

    @classmethod
    def default_configs(cls) -> list[ONNXRuntimeBackendConfig]:
        """Both exports, and for a transformers model its eager attention, as candidates: which one
        ONNX Runtime runs faster depends on the model."""
        dynamo = ONNXExportConfig(fallback_to_torchscript=False)
        return [
            ONNXRuntimeBackendConfig(export=dynamo),
            ONNXRuntimeBackendConfig(export=ONNXExportConfig(exporter="torchscript")),
            ONNXRuntimeBackendConfig(export=dynamo, attention="eager"),  # fails at once outside transformers
        ]

    @classmethod
    def quantized_configs(cls) -> list[ONNXRuntimeBackendConfig]:
        """Dynamic int8 on the dynamo export, tried by default when the user gave an accuracy budget."""
        return [
            ONNXRuntimeBackendConfig(
                quantization="dynamic_int8", export=ONNXExportConfig(fallback_to_torchscript=False)
            )
        ]

    def variant(self) -> str | None:
        words = []
        if self.config.export.exporter == "torchscript":
            words.append("torchscript export")
        if self.config.attention is not None:
            words.append(f"{self.config.attention} attention")
        if self.config.quantization is not None:
            words.append(self.config.quantization.replace("_", " "))
        return ", ".join(words) or None

    def tolerance(self, dtype: torch.dtype) -> Tolerance | None:
        if self.config.quantization is not None and dtype.is_floating_point:
            return INT8_TOLERANCE
        if self.computes_tf32() and dtype == torch.float32:
            return TF32_TOLERANCE
        return None

    def computes_tf32(self) -> bool:
        """CUDA with ``use_tf32``, or the TensorRT provider: TensorRT's TF32 builder flag is on by
        default and the provider has no option that clears it."""
        return self.config.tf32 or self.config.execution_provider is ONNXExecutionProvider.TENSORRT

    # -- what the engine asks first -------------------------------------------------------------

    def provider_for(self, device: torch.device) -> ONNXExecutionProvider:
        """The configured provider, or CUDA on a CUDA device and CPU elsewhere."""
        if self.config.execution_provider is not None:
            return self.config.execution_provider
        return ONNXExecutionProvider.CUDA if device.type == "cuda" else ONNXExecutionProvider.CPU

    def unsupported_reason(self, graph: GraphSpec, device: torch.device) -> str | None:
        provider = self.provider_for(device)
        reason = provider_unavailable(provider.value)
        if reason and provider is not ONNXExecutionProvider.CPU:
            return (
                f"the {provider.ort_name} of ONNX Runtime cannot run here: {reason}; to run on the CPU, use "
                "ONNXRuntimeBackendConfig(execution_provider=ONNXExecutionProvider.CPU)"
            )
        if reason:
            return reason
        if provider is not ONNXExecutionProvider.CPU and device.type != "cuda":
            return (
                f"the {provider.ort_name} runs on a CUDA device but tuning runs on {device}: tune on cuda, or use "
                "execution_provider=ONNXExecutionProvider.CPU (or None, which picks the CPU provider here)"
            )
        for spec in (*graph.inputs, *graph.outputs):
            if spec.dtype in UNSUPPORTED_DTYPES:
                return (
                    f"{spec.path} is {spec.dtype}, which ONNX Runtime's Python API cannot pass in or out; "
                    "cast it to float16 or float32 at the module's boundary, or choose another backend"
                )
        return None

    # -- build ----------------------------------------------------------------------------------

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        reason = self.unsupported_reason(context.graph, context.device)
        if reason:
            raise BackendUnavailableError(f"backend 'onnxruntime' cannot build this graph: {reason}")
        if not context.samples:
            raise BuildError("the onnxruntime backend needs at least one recorded sample to export the module")
        provider = self.provider_for(context.device)
        folder = self._own_folder()
        graph = context.graph
        dims = tuple(sorted((n, r.min, r.max) for n, r in graph.dims.items()))
        attention = effective_attention(module, self.config.attention)  # read before the block changes it
        key = (graph.key, dims, str(context.device), self.config.export, attention)
        with attention_implementation(module, self.config.attention):
            export, shared = shared_export(
                module,
                key,
                context.samples,
                self,
                folder,
                lambda: export_onnx(
                    module, graph, context.samples[0], folder, self.config.export, samples=context.samples
                ),
            )
        save_optimized = self.config.save_optimized_model and provider is not ONNXExecutionProvider.TENSORRT
        self._adopt(export, context.graph, provider)
        if self.config.quantization is not None:
            self._quantize(folder, context)
        else:  # which weight each initializer holds, found while they are the same values
            self._refit_plan = refit_plan(folder / self._model, module.state_dict())
        start = time.perf_counter()
        self._open(
            folder / self._model,
            context.graph,
            context.device,
            provider,
            context.cache_dir,
            optimized_to=folder / OPTIMIZED_FILE if save_optimized else None,
            profile_to=folder / "placement",
        )
        session_seconds = time.perf_counter() - start
        if save_optimized:
            self._optimized = list(model_files(folder / OPTIMIZED_FILE))
        for i, sample in enumerate(context.samples):  # warm-up, and proof that the session runs
            try:
                self.infer(*sample.args, **sample.kwargs)
            except Exception as exc:
                raise BuildError(
                    f"ONNX Runtime ({provider.ort_name}) failed to run the exported model on sample {i}: "
                    f"{type(exc).__name__}: {exc}; try the other exporter (ONNXExportConfig(exporter=...)) "
                    "or another backend"
                ) from exc
            if self._profiling:
                self._check_profiled_placement()
        self.build_info.update(
            exporter=export.exporter,
            opset=export.opset,
            export_s=round(export.seconds, 3),
            session_s=round(session_seconds, 3),
            fallback_reason=export.fallback_reason,
            optimized_model_saved=save_optimized,
            export_shared=shared,  # copied from another variant's export of this graph (export_s is then 0)
        )
        if export.traced_branches:  # where the TorchScript trace froze a value, and how each was judged
            self.build_info["traced_branches"] = list(export.traced_branches)

    def _quantize(self, folder: Path, context: BuildContext) -> None:
        """The exported graph quantized to int8 (dynamic, or static QDQ calibrated on the recorded samples)."""
        from onnxruntime.quantization import (
            CalibrationDataReader,
            QuantFormat,
            QuantType,
            quantize_dynamic,
            quantize_static,
        )

        source, target = folder / MODEL_FILE, folder / INT8_FILE
        external = len(self._files) > 1
        start = time.perf_counter()
        try:
            if self.config.quantization == "dynamic_int8":
                quantize_dynamic(source, target, weight_type=QuantType.QInt8, use_external_data_format=external)
            else:
                feeds = [
                    {
                        name: t.detach().cpu().numpy()
                        for name, t in zip(self._input_names, context.graph.flatten(s.args, s.kwargs))
                    }
                    for s in context.samples
                ]

                class Samples(CalibrationDataReader):
                    def __init__(self) -> None:
                        self.left = iter(feeds)

                    def get_next(self) -> dict[str, Any] | None:
                        return next(self.left, None)

                quantize_static(
                    source,
                    target,
                    Samples(),
                    quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8,
                    use_external_data_format=external,
                )
        except Exception as exc:
            raise BuildError(
                f"ONNX Runtime could not quantize the exported graph ({self.config.quantization}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self._model, self._files = INT8_FILE, list(model_files(target))
        self.build_info["quantize_s"] = round(time.perf_counter() - start, 3)

    def _adopt(self, export: ONNXExport, graph: GraphSpec, provider: ONNXExecutionProvider) -> None:
        self._files = list(export.files)
        self._structure = graph.output_structure or export.output_structure
        self._input_names, self._output_names = export.input_names, export.output_names
        self._meta = {
            "exporter": export.exporter,
            "opset": export.opset,
            "provider": provider.value,
            "fallback_reason": export.fallback_reason,
        }

    def __deepcopy__(self, memo: dict[int, Any]) -> ONNXRuntimeBackend:
        """A copy for ``copy.deepcopy`` of a tuned module. ONNX Runtime's session (and the buffers,
        stream and run options it holds) cannot be copied or pickled: the copy shares them, which is
        safe because the session's weights are read-only, ``run`` may be called from several threads,
        and a refit gives the refitted object a session of its own. The payload folder is copied, so
        either object may be dropped first."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = value if key in _SHARED_ON_COPY else copy.deepcopy(value, memo)
        if self._dir is not None:
            new._dir = None
            shutil.copytree(self._dir, new._own_folder(), dirs_exist_ok=True)
        return new

    # -- sessions -------------------------------------------------------------------------------

    def _own_folder(self) -> Path:
        """A folder this object owns, so the payload outlives the build's scratch folder."""
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="aitune-onnxruntime-"))
            weakref.finalize(self, shutil.rmtree, str(self._dir), True)
        return self._dir

    def _open(
        self,
        model: Path,
        graph: GraphSpec,
        device: torch.device,
        provider: ONNXExecutionProvider,
        cache_dir: Path,
        optimized_to: Path | None = None,
        preoptimized: bool = False,
        initializers: Mapping[str, Any] | None = None,
        profile_to: Path | None = None,
    ) -> None:
        """A session on ``model``. On a GPU provider, where its nodes run is checked: here when ONNX
        Runtime records the assignment, else (``profile_to``, at build) on the profile of the first run."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in (initializers or {}).items()}
        for name, value in values.items():  # refit: these replace the graph's own initializers
            options.add_initializer(name, value)
        level = "disabled" if preoptimized else self.config.graph_optimization_level
        options.graph_optimization_level = {
            "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[level]
        # one thread budget for every candidate: torch's, unless the config names its own (0: ORT's default)
        # a count from the config (perhaps read from a file) is capped at the cores this process may use
        intra, inter = self.config.intra_op_num_threads, self.config.inter_op_num_threads
        cores = machine_cores()
        options.intra_op_num_threads = torch.get_num_threads() if intra is None else min(intra, cores)
        options.inter_op_num_threads = 1 if inter is None else min(inter, cores)  # execution is sequential
        self.build_info["threads"] = options.intra_op_num_threads or "onnxruntime's default"
        options.log_severity_level = 3
        record = provider is not ONNXExecutionProvider.CPU and records_assignment(ort.InferenceSession)
        for key, value in session_config(provider, record).items():
            options.add_session_config_entry(key, value)
        profiling = provider is not ONNXExecutionProvider.CPU and not record and profile_to is not None
        if profiling:
            options.enable_profiling = True
            options.profile_file_prefix = str(profile_to)
        if optimized_to is not None:
            options.optimized_model_filepath = str(optimized_to)
        available = ort.get_available_providers()
        if provider.ort_name not in available:
            raise BackendUnavailableError(
                f"this onnxruntime build has no {provider.ort_name} (it has {available}); install onnxruntime-gpu "
                "for CUDA and TensorRT, or use execution_provider=ONNXExecutionProvider.CPU"
            )
        names = self._input_names or _graph_input_names(model)
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
            graph,
            names,
            self.config.provider_options,
            cache_dir,
            stream=stream.cuda_stream if stream is not None else None,
            model_digest=(
                _model_digest(model, self._files, initializers) if provider is ONNXExecutionProvider.TENSORRT else ""
            ),
        )
        try:
            session = ort.InferenceSession(str(model), options, providers=chain)
        except Exception as exc:
            raise BuildError(
                f"ONNX Runtime could not create a session with the {provider.ort_name}: {exc}; check "
                "provider_options, or try another graph_optimization_level or exporter"
            ) from exc
        if provider.ort_name not in session.get_providers():
            raise BuildError(
                f"ONNX Runtime silently fell back to {session.get_providers()} instead of the {provider.ort_name} "
                "(its libraries failed to load: check that the CUDA, cuDNN and TensorRT versions match the "
                "installed onnxruntime-gpu), so this would not measure what was asked for"
            )
        if record:
            error = fallback_error(
                cpu_compute_from_assignment(session.get_provider_graph_assignment_info()),
                provider.ort_name,
                "by the session's graph assignment",
            )
            if error:
                raise BuildError(error)
            self.build_info["placement"] = "no compute node on the CPU (the session's graph assignment)"
        self._profiling = profiling
        self._session = session
        self._graph = graph
        self._device = device
        self._provider, self._cache_dir = provider, cache_dir
        self._initializers = (dict(initializers or {}), values)  # the session reads these buffers: keep them alive
        self._bound = provider is not ONNXExecutionProvider.CPU and self.config.use_io_binding
        self._stream, self._out_shapes = stream, collections.OrderedDict()
        self._run_options = ort.RunOptions()
        if stream is not None:  # ordering against the caller's stream is done with CUDA events instead
            self._run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        self._outputs = [(_TORCH_FROM_ORT.get(o.type), _dims(o.shape)) for o in session.get_outputs()]
        self.build_info.update(
            provider=provider.value, session_providers=session.get_providers(), io_binding=self._bound
        )

    def _check_profiled_placement(self) -> None:
        """End the profile of the first run and fail the build if it ran compute nodes on the CPU."""
        self._profiling = False
        path = self._session.end_profiling()  # also stops profiling: later runs are not recorded
        if not path:
            raise BuildError("ONNX Runtime wrote no profile of the first run, so where its nodes ran is unknown")
        error = fallback_error(read_profile(path), self._provider.ort_name, "in the profile of the first run")
        if error:
            raise BuildError(error)
        self.build_info["placement"] = "no compute node on the CPU (the profile of the first run)"

    # -- run ------------------------------------------------------------------------------------

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        if self._session is None:
            raise BuildError("ONNXRuntimeBackend used before build() or load()")
        tensors = tree.flatten((args, kwargs))[0]
        outputs = self._run_bound(tensors) if self._bound else self._run_host(tensors)
        return tree.unflatten(self._structure, outputs)

    def _run_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        feed = {name: _numpy(t) for name, t in zip(self._input_names, tensors)}
        arrays = self._session.run(self._output_names, feed)
        outs = [torch.from_numpy(a) for a in arrays]
        if self._device.type != "cpu":
            outs = [o.to(self._device) for o in outs]
        return outs

    def _run_bound(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        assert self._graph is not None
        binding = self._session.io_binding()
        device_id = self._device.index or 0
        caller, stream = torch.cuda.current_stream(self._device), self._stream
        kept, sizes = [], {}
        for t, spec in zip(tensors, self._graph.inputs):
            t = t.detach().to(self._device).contiguous()  # a copy, if any, is queued on the caller's stream
            kept.append(t)
            sizes.update({dim: t.shape[axis] for axis, dim in enumerate(spec.dims) if dim is not None})
        stream.wait_stream(caller)  # after the copies: ONNX Runtime reads the inputs only once they landed
        for name, t in zip(self._input_names, kept):
            t.record_stream(stream)  # ONNX Runtime reads it on its stream: not reused before that is done
            binding.bind_input(name, "cuda", device_id, _numpy_dtype(t.dtype), tuple(t.shape), t.data_ptr())
        key = tuple(tuple(t.shape) for t in kept)
        known = self._out_shapes.get(key)
        if known is not None:
            self._out_shapes.move_to_end(key)
        shapes: Sequence[tuple[int, ...] | None] = known or [resolve_shape(dims, sizes) for _, dims in self._outputs]
        outs: list[torch.Tensor | None] = []
        for name, (dtype, _), shape in zip(self._output_names, self._outputs, shapes):
            if shape is None or dtype is None:
                binding.bind_output(name, "cuda", device_id)
                outs.append(None)
                continue
            out = torch.empty(shape, dtype=dtype, device=self._device)
            binding.bind_output(name, "cuda", device_id, _numpy_dtype(dtype), shape, out.data_ptr())
            outs.append(out)
        self._session.run_with_iobinding(binding, self._run_options)
        if any(o is None for o in outs):  # first call of these shapes: ONNX Runtime allocated some outputs
            stream.synchronize()
            values = binding.get_outputs()
            outs = [o if o is not None else _from_ort(values[i], self._device) for i, o in enumerate(outs)]
            self._out_shapes[key] = [tuple(o.shape) for o in outs]  # type: ignore[union-attr]
            while len(self._out_shapes) > MAX_KNOWN_SHAPES:
                self._out_shapes.popitem(last=False)
        caller.wait_stream(stream)  # the caller's later work sees the outputs
        return outs  # type: ignore[return-value]

    # -- artifact -------------------------------------------------------------------------------

    def refit(self, weights: Mapping[str, torch.Tensor]) -> bool:
        """A new session on the same exported graph whose initializers are the new weights
        (``SessionOptions.add_initializer``), without exporting again. Which weight each initializer
        holds was found when the graph was built, by name or by value (the exporters store a
        ``Linear`` weight transposed as an anonymous constant); False for a quantized graph, whose
        initializers are int8, and where nothing maps. A weight folded some other way (fused,
        scaled) keeps its old value, and the check against eager that follows catches it."""
        if self._session is None or self._dir is None or self._graph is None or self.config.quantization is not None:
            return False
        overrides: dict[str, Any] = {}
        for name, (key, transposed) in self._refit_plan.items():
            tensor = weights.get(key)
            if tensor is None or tensor.dtype not in _NUMPY_DTYPES:
                return False
            overrides[name] = _numpy(tensor.detach().t() if transposed else tensor)
        if not overrides:
            return False
        model = self._dir / self._model
        self._open(model, self._graph, self._device, self._provider, self._cache_dir, initializers=overrides)
        self.build_info.update(refitted=True, refitted_initializers=len(overrides))
        return True

    def save(self, directory: Path) -> dict[str, Any]:
        if self._session is None or self._dir is None:
            raise SerializationError("ONNXRuntimeBackend.save() before build() or load(): nothing to save")
        files = list(dict.fromkeys(self._files + self._optimized))
        for name in files:
            shutil.copy2(self._dir / name, Path(directory) / name)
        return {
            **self._meta,
            "model": self._model,
            "files": files,
            "optimized_model": OPTIMIZED_FILE if self._optimized else None,
            "input_names": list(self._input_names),
            "output_names": list(self._output_names),
            "output_structure": self._structure,
            "refit_plan": {name: [key, transposed] for name, (key, transposed) in self._refit_plan.items()},
        }

    def load(self, module: torch.nn.Module, directory: Path, context: LoadContext) -> None:
        meta = context.metadata
        try:
            files = [str(f) for f in meta["files"]]
            input_names, output_names = tuple(meta["input_names"]), tuple(meta["output_names"])
        except (KeyError, TypeError) as exc:
            raise SerializationError(f"onnxruntime payload metadata lacks {exc}; re-tune and save again") from exc
        for name in files:
            if not payload_file(directory, name).is_file():
                raise SerializationError(
                    f"onnxruntime payload misses the file {name!r} it lists; the artifact is incomplete"
                )
        for key in ("model", "optimized_model"):  # the graph ONNX Runtime opens is one of those files
            if meta.get(key) is not None and meta[key] not in files:
                raise SerializationError(
                    f"onnxruntime payload names {key} {meta[key]!r}, which is not one of its files; the artifact "
                    "is corrupt or hostile"
                )
        reason = self.unsupported_reason(context.graph, context.device)
        if reason:
            raise BackendUnavailableError(f"cannot load the onnxruntime payload here: {reason}")
        folder = self._own_folder()
        for name in files:
            _link_or_copy(payload_file(directory, name), payload_file(folder, name))
        provider = self.provider_for(context.device)
        preoptimized = bool(meta.get("optimized_model")) and meta.get("provider") == provider.value
        self._input_names, self._output_names = input_names, output_names
        self._structure = context.graph.output_structure or meta["output_structure"]
        self._files = [f for f in files if f != meta.get("optimized_model")]
        self._optimized = files if meta.get("optimized_model") else []  # a superset of what it references
        self._meta = {k: meta.get(k) for k in ("exporter", "opset", "provider", "fallback_reason")}
        self._model = str(meta.get("model", MODEL_FILE))
        self._refit_plan = _plan_from_file(meta.get("refit_plan"))
        model = payload_file(folder, meta["optimized_model"] if preoptimized else self._model)
        outside = external_data_outside(model, files)
        if outside:
            raise SerializationError(
                f"the onnxruntime payload's graph keeps tensor data in {outside!r}, which is not one of its files; "
                "the artifact is corrupt or hostile"
            )
        if not self._refit_plan and self.config.quantization is None:  # saved before plans were: the module
            self._refit_plan = refit_plan(payload_file(folder, self._model), module.state_dict())  # holds its weights
        start = time.perf_counter()
        try:
            self._open(model, context.graph, context.device, provider, context.cache_dir, preoptimized=preoptimized)
        except BuildError as exc:
            raise SerializationError(f"cannot load the onnxruntime payload: {exc}") from exc
        self.build_info.update(
            loaded_optimized_model=preoptimized, session_s=round(time.perf_counter() - start, 3), exported=False
        )


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
    """The ``providers`` list for the session: the asked-for provider first, its fallbacks after.

    For TensorRT, the graph's min/opt/max shapes become the engine's optimisation profile and
    engines are cached under aitune's cache folder, so a load does not rebuild them. The provider's
    cache key hashes names, not weights, so each payload's engines get a prefix of their own from
    ``model_digest`` (which covers a refit's new initializers): neither a fine-tune nor a refit
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


def session_config(provider: ONNXExecutionProvider, record_assignment: bool) -> dict[str, str]:
    """Session config entries. A GPU session may leave nodes to the CPU provider (the CUDA provider
    keeps shape arithmetic there on purpose), so ``session.disable_cpu_ep_fallback`` is never set:
    it refuses such graphs, and refuses any session that lists the CPU provider. Instead the
    placement is recorded, where ONNX Runtime can, and checked for compute nodes (``placement``)."""
    if provider is ONNXExecutionProvider.CPU or not record_assignment:
        return {}
    return {RECORD_KEY: "1"}


def _model_digest(model: Path, files: Sequence[str], initializers: Mapping[str, Any] | None = None) -> str:
    """SHA-256 of the graph, the external-data files beside it and the initializers that replace the
    graph's own (a refit): what its TensorRT engine is of."""
    digest = hashlib.sha256()
    for path in [model, *(model.parent / f for f in files if f != model.name)]:
        if path.is_file():
            with open(path, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
    for name in sorted(initializers or {}):
        array = initializers[name]  # type: ignore[index]
        digest.update(f"\0{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        digest.update(array.tobytes())
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


def refit_plan(model: Path, weights: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, bool]]:
    """Which module weight each initializer of ``model`` holds: by name (``module.<name>``), else by
    equal values, as is or transposed (a ``Linear`` weight the exporter stored for ``MatMul``). An
    initializer equal to several weights of different names maps to none of them: refitting it
    would be a guess."""
    import onnx
    from onnx import numpy_helper

    by_shape: dict[tuple[int, ...], list[tuple[str, torch.Tensor, bool]]] = collections.defaultdict(list)
    for key, tensor in weights.items():
        if tensor.dtype in _NUMPY_DTYPES and tensor.device.type != "meta":
            host = tensor.detach().cpu()  # once per weight, however many initializers it is compared with
            by_shape[tuple(host.shape)].append((key, host, False))
            if host.dim() == 2:
                by_shape[tuple(host.t().shape)].append((key, host.t(), True))
    plan: dict[str, tuple[str, bool]] = {}
    for init in onnx.load(str(model), load_external_data=False).graph.initializer:
        key = init.name.removeprefix("module.")
        if key in weights and tuple(weights[key].shape) == tuple(init.dims):
            plan[init.name] = (key, False)
            continue
        candidates = by_shape.get(tuple(init.dims))
        if not candidates or init.data_location == onnx.TensorProto.EXTERNAL:
            continue  # an external-data tensor is not read here: only its name can map it
        value = torch.from_numpy(numpy_helper.to_array(init).copy())
        found = {(k, t) for k, host, t in candidates if torch.equal(host, value)}
        if len({k for k, _ in found}) == 1:
            plan[init.name] = next(iter(found))
    return plan


def _plan_from_file(data: Any) -> dict[str, tuple[str, bool]]:
    """A refit plan from a payload's metadata (untrusted): names and flags only, anything else ignored."""
    if not isinstance(data, dict):
        return {}
    plan = {}
    for name, entry in data.items():
        if (
            isinstance(name, str)
            and isinstance(entry, list)
            and len(entry) == 2
            and isinstance(entry[0], str)
            and isinstance(entry[1], bool)
        ):
            plan[name] = (entry[0], entry[1])
    return plan


_NUMPY_DTYPES = frozenset(
    {torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool}
)
"""Weight dtypes numpy holds as they are (bfloat16 has no numpy twin: such a graph is not refitted)."""


def _numpy(t: torch.Tensor) -> Any:
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


def _attention_configs(module: torch.nn.Module) -> list[Any]:
    """The transformers configs in ``module`` that name an attention implementation."""
    configs = (getattr(m, "config", None) for m in module.modules())
    return [c for c in configs if c is not None and hasattr(c, "_attn_implementation")]


def effective_attention(module: torch.nn.Module, chosen: str | None) -> str | None:
    """``chosen``, or None when every attention config of ``module`` already uses it: the export is
    then the plain variant's, and is shared with it."""
    configs = _attention_configs(module)
    if chosen is not None and configs and all(c._attn_implementation == chosen for c in configs):
        return None
    return chosen


@contextlib.contextmanager
def attention_implementation(module: torch.nn.Module, chosen: str | None) -> Iterator[None]:
    """``module``'s transformers configs set to the attention implementation ``chosen`` while the block
    runs, then restored; a module with no such config cannot take that variant (NotApplicableError: the
    report lists it as not applicable, not as a failure)."""
    if chosen is None:
        yield
        return
    configs = {id(c): c for c in _attention_configs(module)}
    if not configs:
        raise NotApplicableError(
            f"the {chosen} attention variant applies to transformers models only; this one has no attention config"
        )
    before = {key: config._attn_implementation for key, config in configs.items()}
    try:
        for config in configs.values():
            config._attn_implementation = chosen
        yield
    finally:
        for key, config in configs.items():
            config._attn_implementation = before[key]


def external_data_outside(model: Path, files: Sequence[str]) -> str | None:
    """The first external-data location of ``model`` that is not one of the payload's ``files``, or None.

    An ONNX graph may keep tensors in other files, named inside the graph: from an artifact, such a
    name could point anywhere on the machine, so every one must be a file the payload carries.
    """
    import onnx
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    proto = onnx.load(str(model), load_external_data=False)
    for tensor in _get_all_tensors(proto):
        if not uses_external_data(tensor):
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        if location not in files:
            return location
    return None


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
