"""TensorRTBackend: the module exported to ONNX by core, optionally cast or quantized by ModelOpt,
built into a TensorRT engine with one optimisation profile per shape regime, run on torch tensors."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from aitune.plugin import (
    EXPORTER_MODULES,
    ArtifactError,
    Backend,
    BackendConfig,
    BackendUnavailableError,
    BuildContext,
    BuildError,
    ConfigError,
    GraphSpec,
    LoadContext,
    Tolerance,
    exported_file,
)

from . import compat, layers
from .config import ModelOptQuantizationConfig, ONNXAutoCastConfig, TensorRTBackendConfig
from .profiles import ShapeProfile, resolve_profiles, uncovered

PLAN_FILE = "engine.plan"
METADATA_VERSION = 1
_UNSUPPORTED_DTYPES = ("float64", "complex64", "complex128")


class TensorRTBackend(Backend):
    """TensorRT engine built from the ONNX export."""

    name = "tensorrt"
    config_class = TensorRTBackendConfig
    native_build = True
    build_cost = 10.0  # TensorRT times kernel tactics for every layer
    warm_imports = (*EXPORTER_MODULES, "tensorrt", "modelopt.onnx.quantization")  # ONNX export, then TensorRT
    native_payload = True  # a serialized engine (plan) the TensorRT runtime executes
    config: TensorRTBackendConfig

    def __init__(self, config: TensorRTBackendConfig | None = None) -> None:
        super().__init__(config)
        self._graph: GraphSpec | None = None
        self._runner: Any = None
        self._plan: bytes | None = None
        self._metadata: dict[str, Any] = {}

    # -- what the engine asks before building -------------------------------------------------

    def unsupported_reason(self, graph: GraphSpec, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"TensorRT runs on CUDA devices only, not {device.type!r}"
        if not graph.inputs:
            return "the graph has no tensor inputs; TensorRT needs at least one"
        if graph.output_structure is None or not graph.outputs:
            return "the graph has no recorded tensor outputs to bind"
        for spec in (*graph.inputs, *graph.outputs):
            if spec.dtype in _UNSUPPORTED_DTYPES:
                return f"{spec.path} is {spec.dtype}, which TensorRT does not support; use float32 or lower"
        return None

    def tolerance(self, dtype: torch.dtype) -> Tolerance | None:
        if not dtype.is_floating_point:
            return None
        quantization = self.config.quantization_config
        if isinstance(quantization, ModelOptQuantizationConfig):
            return Tolerance(atol=5e-2, rtol=1e-1, min_cosine=0.99)
        if isinstance(quantization, ONNXAutoCastConfig):
            if quantization.low_precision_type == "bf16":
                return Tolerance(atol=1e-2, rtol=5e-2, min_cosine=0.99)
            return Tolerance(atol=1e-3, rtol=1e-2, min_cosine=0.999)
        if dtype == torch.float32 and self.config.tf32:
            return Tolerance(atol=1e-4, rtol=5e-3, min_cosine=0.9999)  # TF32 keeps 10 mantissa bits
        return None

    def computes_tf32(self) -> bool:
        """``tf32`` leaves TensorRT's TF32 builder flag on (its default); False clears it."""
        return self.config.tf32

    # -- build ----------------------------------------------------------------------------------
    #
    # A build is three steps, the same in-process and isolated: ``export`` (ONNX, then AutoCast or
    # quantization, in the user's process), ``build_exported`` (the engine, from those files
    # alone; in aitune's worker process when the build is isolated), then loading the plan.

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        reason = self.unsupported_reason(context.graph, context.device) or compat.availability_reason(
            context.device.type
        )
        if reason:
            raise BackendUnavailableError(f"backend 'tensorrt' cannot build here: {reason}")
        folder = context.workdir / "tensorrt"
        payload = folder / "payload"
        payload.mkdir(parents=True, exist_ok=True)
        notes = self.export(module, context, folder / "exported")
        metadata = self.build_exported(self.config, folder / "exported", notes, context, payload)
        self._graph, self._plan, self._metadata = context.graph, (payload / PLAN_FILE).read_bytes(), metadata
        self._start_runner(context.device)
        with torch.no_grad():
            for sample in context.samples:  # warm-up (and CUDA graph capture) belong to the build
                self.infer(*sample.args, **sample.kwargs)
        torch.cuda.synchronize(context.device)
        self.build_info.update(metadata["build"], precision=metadata["precision"])

    def export(self, module: torch.nn.Module, context: BuildContext, directory: Path) -> dict[str, Any]:
        """The ONNX model the engine is built from, with its precision lowered, written into ``directory``.

        Runs without TensorRT or a GPU. The notes (JSON) carry everything the engine build needs
        besides the files: the model's file names, input and output names, paths and dtypes, the
        optimisation profiles by input name and the precision label.
        """
        graph = context.graph
        reason = self.unsupported_reason(graph, context.device)
        if reason:
            raise BackendUnavailableError(f"backend 'tensorrt' cannot build here: {reason}")
        if not context.samples:
            raise BuildError("TensorRT needs at least one recorded sample to export and warm up the engine")
        profiles = resolve_profiles(graph, self.config.profiles)
        cases = [[tuple(t.shape) for t in graph.flatten(s.args, s.kwargs)] for s in context.samples]
        gap = uncovered(graph, profiles, cases)
        if gap:
            raise ConfigError(f"TensorRTBackendConfig.profiles: {gap}")

        from aitune.plugin import ONNXExportConfig, export_onnx, model_files

        directory = Path(directory)
        start = time.perf_counter()
        exported = export_onnx(
            module,
            graph,
            context.samples[0],
            directory,
            ONNXExportConfig(exporter=self.config.onnx_exporter, opset=self.config.onnx_opset),
        )
        info: dict[str, Any] = {
            "onnx_exporter": exported.exporter,
            "onnx_opset": exported.opset,
            "export_seconds": round(time.perf_counter() - start, 3),
        }
        onnx_path, precision = self._lower_precision(exported, graph, context, info, directory)
        names = list(exported.input_names)
        return {
            "onnx": onnx_path.name,
            "files": list(model_files(onnx_path)),
            "input_names": names,
            "profiles": [p.to_json(names) for p in profiles],
            "inputs": [{"name": n, "path": s.path, "dtype": s.dtype} for n, s in zip(names, graph.inputs)],
            "outputs": [
                {"name": n, "path": s.path, "dtype": s.dtype} for n, s in zip(exported.output_names, graph.outputs)
            ],
            "precision": precision,
            "export": info,
        }

    @classmethod
    def build_exported(
        cls,
        config: BackendConfig,
        exported: Path,
        notes: dict[str, Any],
        context: BuildContext,
        payload: Path,
    ) -> dict[str, Any]:
        """Build the engine from the ONNX model ``export`` wrote; write ``engine.plan`` into ``payload``.

        Needs TensorRT and the CUDA device the engine is for; returns the metadata ``load`` reads.
        """
        if not isinstance(config, TensorRTBackendConfig):
            raise TypeError(f"{cls.__name__} builds from a TensorRTBackendConfig, got {type(config).__name__}")
        reason = compat.availability_reason(context.device.type)
        if reason:
            raise BackendUnavailableError(f"backend 'tensorrt' cannot build here: {reason}")
        onnx_path = exported_file(Path(exported), notes, "onnx")
        names = list(notes["input_names"])
        profiles = [ShapeProfile.from_json(p, names) for p in notes["profiles"]]
        machine = compat.this_machine(context.device.index)
        from .engine import build_plan, timing_cache_path

        cache = timing_cache_path(context.cache_dir, machine) if config.use_timing_cache else None
        with torch.cuda.device(context.device):  # TensorRT builds for the current CUDA device
            plan, engine_info = build_plan(onnx_path, profiles, names, config, cache)
            opts = [[(name, triple[1]) for name, triple in zip(names, p.shapes)] for p in profiles]
            failure = None
            try:
                described = layers.plan_information(plan, opts, config.version_compatible)
            except Exception as exc:  # without a description a lower precision cannot be checked (below)
                described, failure = [], f"the engine inspector failed ({type(exc).__name__}: {exc})"
        problem = layers.precision_problem(layers.requested_precision(config), described, failure)
        if problem:
            raise BuildError(problem)
        counts = layers.layer_precisions(described[0]) if described else {}
        engine_info["layer_precisions"] = counts or (
            f"not reported: {failure}" if failure else "not reported by this TensorRT"
        )
        if not engine_info["dynamic"]:
            profiles = profiles[:1]
        (Path(payload) / PLAN_FILE).write_bytes(plan)
        return {
            "metadata_version": METADATA_VERSION,
            "plan": PLAN_FILE,
            "tensorrt_version": engine_info["tensorrt_version"],
            "gpu_name": machine.gpu_name,
            "compute_capability": list(machine.compute_capability or ()),
            "hardware_compatible": config.hardware_compatible,
            "version_compatible": config.version_compatible,
            "precision": notes["precision"],
            "profiles": [p.to_json(names) for p in profiles],
            "inputs": notes["inputs"],
            "outputs": notes["outputs"],
            "build": {**notes.get("export", {}), **engine_info},
        }

    def _lower_precision(
        self, exported: Any, graph: GraphSpec, context: BuildContext, info: dict[str, Any], directory: Path
    ) -> tuple[Path, str]:
        quantization = self.config.quantization_config
        if quantization is None:
            return exported.path, "as exported (strongly typed)" if self.config.strongly_typed else "builder flags"
        from . import precision

        feeds = precision.calibration_feeds(graph, context.samples, exported.input_names)
        start = time.perf_counter()
        scratch = context.workdir / "tensorrt-calibration"
        scratch.mkdir(parents=True, exist_ok=True)
        if isinstance(quantization, ONNXAutoCastConfig):
            path = precision.autocast(
                exported.path, quantization, feeds, scratch, output=directory, device_index=context.device.index or 0
            )
            label = f"{quantization.low_precision_type} (ModelOpt AutoCast)"
        else:
            path, served = precision.quantize(
                exported.path,
                quantization,
                feeds,
                scratch,
                external_data=len(exported.files) > 1,
                output=directory,
                device_index=context.device.index or 0,
            )
            info["calibration_samples"] = served
            label = f"{quantization.mode} (ModelOpt quantization)"
        info["precision_seconds"] = round(time.perf_counter() - start, 3)
        return path, label

    def _start_runner(self, device: torch.device) -> None:
        from .runtime import EngineRunner

        assert self._graph is not None and self._plan is not None
        names = [i["name"] for i in self._metadata["inputs"]]
        self._runner = EngineRunner(
            self._plan,
            input_names=names,
            output_names=[o["name"] for o in self._metadata["outputs"]],
            profiles=[ShapeProfile.from_json(p, names) for p in self._metadata["profiles"]],
            device=device,
            output_dtypes=[s.torch_dtype for s in self._graph.outputs],
            use_cuda_graphs=self.config.use_cuda_graphs,
            graph_memory=self.config.cuda_graph_memory,
            version_compatible=bool(self._metadata.get("version_compatible")),
        )

    # -- run ------------------------------------------------------------------------------------

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        if self._runner is None or self._graph is None:
            raise BuildError("TensorRTBackend.infer was called before build() or load()")
        outputs = self._runner.run(self._graph.flatten(args, kwargs))
        return self._graph.unflatten_outputs(outputs)

    # -- artifact -------------------------------------------------------------------------------

    def save(self, directory: Path) -> dict[str, Any]:
        if self._plan is None:
            raise ArtifactError("TensorRTBackend.save was called before build() or load(); build it first")
        (directory / PLAN_FILE).write_bytes(self._plan)
        return dict(self._metadata)

    def load(self, module: torch.nn.Module, directory: Path, context: LoadContext) -> None:
        metadata = dict(context.metadata)
        if metadata.get("metadata_version") != METADATA_VERSION or metadata.get("plan") != PLAN_FILE:
            raise ArtifactError(
                f"this TensorRT payload has metadata version {metadata.get('metadata_version')!r}; this "
                f"aitune-backend-tensorrt reads version {METADATA_VERSION}: upgrade it or re-tune"
            )
        if context.device.type != "cuda":
            raise BackendUnavailableError(f"a TensorRT plan runs on CUDA devices only, not {context.device.type!r}")
        compat.check_compatible(metadata, compat.this_machine(context.device.index))  # before TensorRT parses it
        plan_path = directory / PLAN_FILE
        if not plan_path.is_file():
            raise ArtifactError(f"the TensorRT payload has no {PLAN_FILE}; the artifact is incomplete, re-save it")
        self._graph, self._plan, self._metadata = context.graph, plan_path.read_bytes(), metadata
        start = time.perf_counter()
        self._start_runner(context.device)
        self.build_info.update(metadata.get("build") or {})
        self.build_info.update(
            {"loaded": True, "load_seconds": round(time.perf_counter() - start, 3), "precision": metadata["precision"]}
        )
