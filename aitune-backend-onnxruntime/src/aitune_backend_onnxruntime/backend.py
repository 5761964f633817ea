"""ONNXRuntimeBackend: the module exported to ONNX and run by ONNX Runtime.

The backend composes three parts: the export (:mod:`.export`: the ONNX files, int8 when asked, and
which weight each initializer holds), the runner (:mod:`.runner`: ONNX Runtime on the files, its
placement checks, threads and IO binding) and the payload (:mod:`.payload`: save and load).
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from aitune.plugin import (
    EXPORTER_MODULES,
    OWNER_FILE,
    Backend,
    BackendUnavailableError,
    BuildContext,
    BuildError,
    GraphSpec,
    LoadContext,
    ONNXExportConfig,
    SerializationError,
    Tolerance,
    model_files,
    owned_folder,
    payload_file,
    tree,
)

from . import payload
from .config import INT8_TOLERANCE, TF32_TOLERANCE, ONNXExecutionProvider, ONNXRuntimeBackendConfig
from .export import (
    NUMPY_DTYPES,
    ExportedModel,
    batch_norm_eps,
    export_graph,
    plan_value,
    quantize,
    refit_plan,
    write_refit_copy,
)
from .payload import OPTIMIZED_FILE
from .plugin import provider_unavailable
from .runner import ORTRunner, disabled_optimizers, numpy_of

UNSUPPORTED_DTYPES = ("bfloat16", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")


class ONNXRuntimeBackend(Backend):
    """ONNX export run by ONNX Runtime (CPU, CUDA or TensorRT execution provider)."""

    name = "onnxruntime"
    config_class = ONNXRuntimeBackendConfig
    config: ONNXRuntimeBackendConfig
    builds_static = True  # a dim whose range is one size is exported static (aitune.onnx_export)
    warm_imports = (*EXPORTER_MODULES, "onnxruntime")

    def __init__(self, config: ONNXRuntimeBackendConfig | None = None) -> None:
        super().__init__(config)
        self.exported: ExportedModel | None = None
        """The graph's files (in the folder this object owns) and what describes them."""
        self.runner: ORTRunner | None = None
        """ONNX Runtime on ``exported``; None before a build or load succeeded."""
        self._dir: Path | None = None
        self._refit_dir: Path | None = None
        """The copy of the graph with refitted weights the session runs, inside ``_dir``."""
        self._leaves = tree.CallLeaves({})
        """A call's tensors in the graph's input order (set for the graph at build and load)."""

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
        export, shared = export_graph(module, context, self.config, self, folder)
        save_optimized = self.config.save_optimized_model and provider is not ONNXExecutionProvider.TENSORRT
        exported = self.exported = ExportedModel.of(export, folder, context.graph, provider)
        if self.config.quantization is not None:
            self.build_info["quantize_s"] = round(quantize(exported, context, self.config.quantization), 3)
        else:  # which weight each initializer holds, found while they are the same values
            exported.refit_plan = refit_plan(folder / exported.model, module.state_dict(), batch_norm_eps(module))
        runner = self._runner(context.graph, context.device, provider, context.cache_dir)
        self._leaves = tree.CallLeaves(context.graph.structure)
        start = time.perf_counter()
        runner.open(
            folder / exported.model,
            exported.files,
            optimized_to=folder / OPTIMIZED_FILE if save_optimized else None,
            profile_to=folder / "placement",
        )
        open_seconds = time.perf_counter() - start
        self.runner = runner
        if save_optimized:
            exported.optimized = list(model_files(folder / OPTIMIZED_FILE))
            exported.optimized_without = list(disabled_optimizers(provider))
        for i, sample in enumerate(context.samples):  # warm-up, and proof that ONNX Runtime runs it
            try:
                self.infer(*sample.args, **sample.kwargs)
            except Exception as exc:
                raise BuildError(
                    f"ONNX Runtime ({provider.ort_name}) failed to run the exported model on sample {i}: "
                    f"{type(exc).__name__}: {exc}; try the other exporter (ONNXExportConfig(exporter=...)) "
                    "or another backend"
                ) from exc
            if runner.profiling:
                runner.check_profiled_placement()
        self.build_info.update(
            exporter=export.exporter,
            opset=export.opset,
            export_s=round(export.seconds, 3),
            session_s=round(open_seconds, 3),
            fallback_reason=export.fallback_reason,
            optimized_model_saved=save_optimized,
            export_shared=shared,  # copied from another variant's export of this graph (export_s is then 0)
        )
        if export.traced_branches:  # where the export held a branch or a size condition, and how each was judged
            self.build_info["traced_branches"] = list(export.traced_branches)

    def _runner(
        self, graph: GraphSpec, device: torch.device, provider: ONNXExecutionProvider, cache_dir: Path
    ) -> ORTRunner:
        assert self.exported is not None
        names = self.exported.input_names, self.exported.output_names
        return ORTRunner(self.config, graph, device, provider, cache_dir, *names, notes=self.build_info)

    def __deepcopy__(self, memo: dict[int, Any]) -> ONNXRuntimeBackend:
        """A copy for ``copy.deepcopy`` of a tuned module. Its runner shares ONNX Runtime's objects
        with this one's (see :meth:`ORTRunner.__deepcopy__`); the payload folder is copied, so either
        object may be dropped first."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        if self._dir is not None:
            new._dir = None
            folder = new._own_folder()
            shutil.copytree(self._dir, folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns(f"{OWNER_FILE}*"))
            if new.exported is not None:
                new.exported.folder = folder
            if self._refit_dir is not None:
                new._refit_dir = folder / self._refit_dir.name
        return new

    def _own_folder(self) -> Path:
        """A folder this object owns, so the payload outlives the build's scratch folder (and not for long
        the process, if it is killed outright: :func:`aitune.plugin.owned_folder`)."""
        if self._dir is None:
            self._dir = owned_folder("aitune-onnxruntime-", self)
        return self._dir

    # -- run ------------------------------------------------------------------------------------

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        if self.runner is None or self.exported is None:
            raise BuildError("ONNXRuntimeBackend used before build() or load()")
        return tree.unflatten(self.exported.output_structure, self.runner.run(self._leaves(args, kwargs)))

    def runs_host_arrays(self) -> bool:
        """On the CPU provider: ONNX Runtime takes numpy arrays and answers with them."""
        runner = self.runner
        return runner is not None and not runner.bound and runner.device.type == "cpu"

    def infer_host(self, arrays: Sequence[Any]) -> list[Any]:
        if self.runner is None:
            raise BuildError("ONNXRuntimeBackend used before build() or load()")
        return self.runner.run_arrays(arrays)

    # -- artifact -------------------------------------------------------------------------------

    def refit(self, weights: Mapping[str, torch.Tensor]) -> bool:
        """ONNX Runtime opened anew on a copy of the exported graph whose initializers hold the new
        weights, without exporting again. Which weight each initializer holds was found when the
        graph was built (:func:`.export.refit_plan`): by name, by value (the exporters store a
        ``Linear`` weight transposed as an anonymous constant) or as a layer folded with its batch
        norm. The new values go into the file, not ``SessionOptions.add_initializer``, because ONNX
        Runtime's constant folding reads the file's and ignores overrides of what it folded; the
        TensorRT provider's engine-cache prefix follows the copy's digest, so no engine of the old
        weights is reused. False for a quantized graph, whose initializers are int8, and where
        nothing maps. A weight folded some other way keeps its old value, and the check against
        eager that follows catches it."""
        exported = self.exported
        if self.runner is None or exported is None or self.config.quantization is not None:
            return False
        values: dict[str, Any] = {}
        for name, entry in exported.refit_plan.items():
            tensor = plan_value(entry, weights)
            if tensor is None or tensor.dtype not in NUMPY_DTYPES:
                return False
            values[name] = numpy_of(tensor)
        if not values:
            return False
        start = time.perf_counter()
        folder = Path(tempfile.mkdtemp(prefix="refit-", dir=self._own_folder()))
        try:
            model, files = write_refit_copy(exported, values, folder)
            self.runner.open(model, files)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if self._refit_dir is not None:  # the session of the old copy is gone: its files too
            shutil.rmtree(self._refit_dir, ignore_errors=True)
        self._refit_dir = folder
        self.build_info.update(
            refitted=True, refitted_initializers=len(values), refit_s=round(time.perf_counter() - start, 3)
        )
        return True

    def save(self, directory: Path) -> dict[str, Any]:
        if self.runner is None or self.exported is None:
            raise SerializationError("ONNXRuntimeBackend.save() before build() or load(): nothing to save")
        return payload.save(self.exported, directory)

    def load(self, module: torch.nn.Module, directory: Path, context: LoadContext) -> None:
        meta = context.metadata
        saved = payload.read(meta, directory, context.graph.output_structure)
        reason = self.unsupported_reason(context.graph, context.device)
        if reason:
            raise BackendUnavailableError(f"cannot load the onnxruntime payload here: {reason}")
        exported = self.exported = payload.copied_to(saved, self._own_folder())
        provider = self.provider_for(context.device)
        preoptimized = (
            bool(meta.get("optimized_model"))
            and meta.get("provider") == provider.value
            and _names(meta.get("optimized_without")) == sorted(disabled_optimizers(provider))
        )  # an optimized graph of another provider, or with rewrites this session leaves out, is not used
        model = payload_file(exported.folder, meta["optimized_model"] if preoptimized else exported.model)
        outside = payload.external_data_outside(model, [*exported.files, *exported.optimized])
        if outside:
            raise SerializationError(
                f"the onnxruntime payload's graph keeps tensor data in {outside!r}, which is not one of its files; "
                "the artifact is corrupt or hostile"
            )
        if not exported.refit_plan and self.config.quantization is None:  # saved before plans were: the module
            exported.refit_plan = refit_plan(
                payload_file(exported.folder, exported.model), module.state_dict(), batch_norm_eps(module)
            )
        runner = self._runner(context.graph, context.device, provider, context.cache_dir)
        self._leaves = tree.CallLeaves(context.graph.structure)
        start = time.perf_counter()
        try:
            runner.open(model, exported.files, preoptimized=preoptimized)
        except BuildError as exc:
            raise SerializationError(f"cannot load the onnxruntime payload: {exc}") from exc
        self.runner = runner
        self.build_info.update(
            loaded_optimized_model=preoptimized, session_s=round(time.perf_counter() - start, 3), exported=False
        )


def _names(value: Any) -> list[str]:
    """A list of names read from a payload's metadata (untrusted), sorted; anything else is none."""
    return sorted(v for v in value if isinstance(v, str)) if isinstance(value, list) else []
