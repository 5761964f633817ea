"""Configuration of the onnxruntime backend; imports no runtime."""

from __future__ import annotations

import enum
from typing import Any

import attrs

from aitune.plugin import BackendConfig, ConfigError, ONNXExportConfig, Tolerance


class ONNXExecutionProvider(str, enum.Enum):
    """Where ONNX Runtime runs the model."""

    CPU = "cpu"
    CUDA = "cuda"
    TENSORRT = "tensorrt"

    @property
    def ort_name(self) -> str:
        return {
            "cpu": "CPUExecutionProvider",
            "cuda": "CUDAExecutionProvider",
            "tensorrt": "TensorrtExecutionProvider",
        }[self.value]


OPTIMIZATION_LEVELS = ("disabled", "basic", "extended", "all")
QUANTIZATIONS = (None, "dynamic_int8", "static_int8")
ATTENTIONS = (None, "eager", "sdpa")
INT8_TOLERANCE = Tolerance(atol=1e-4, rtol=0.05, min_cosine=0.995)
"""The bound a quantized ONNX Runtime candidate declares: int8 costs a few percent of the output's scale."""
TF32_TOLERANCE = Tolerance(atol=1e-4, rtol=5e-3, min_cosine=0.9999)
"""fp32 outputs of the CUDA provider with ``provider_options={"use_tf32": "1"}`` (10 mantissa bits)."""


def _provider(value: Any) -> ONNXExecutionProvider | None:
    if value is None or isinstance(value, ONNXExecutionProvider):
        return value
    try:
        return ONNXExecutionProvider(str(value).lower())
    except ValueError:
        raise ConfigError(
            f"ONNXRuntimeBackendConfig.execution_provider is {value!r}; choose one of "
            f"{[p.value for p in ONNXExecutionProvider]} (ONNXExecutionProvider.CPU, .CUDA, .TENSORRT) or None"
        ) from None


def _options(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ConfigError(f"ONNXRuntimeBackendConfig.provider_options must be a dict of option -> value, got {value!r}")
    return {str(k): str(v) for k, v in value.items()}


def _level(instance: Any, attribute: Any, value: Any) -> None:
    if value not in OPTIMIZATION_LEVELS:
        raise ConfigError(
            f"ONNXRuntimeBackendConfig.graph_optimization_level is {value!r}; choose one of {list(OPTIMIZATION_LEVELS)}"
        )


def _threads(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ConfigError(
            f"ONNXRuntimeBackendConfig.{attribute.name} is {value!r}; give a thread count >= 1, "
            "None for torch's thread budget, or 0 for ONNX Runtime's own default"
        )


def _bool(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"ONNXRuntimeBackendConfig.{attribute.name} must be True or False, got {value!r}")


def _export(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, ONNXExportConfig):
        raise ConfigError(f"ONNXRuntimeBackendConfig.export must be an ONNXExportConfig, got {value!r}")


FILE_SAFE_PROVIDER_OPTIONS = frozenset(
    {
        "device_id",
        "arena_extend_strategy",
        "gpu_mem_limit",
        "cudnn_conv_algo_search",
        "cudnn_conv_use_max_workspace",
        "cudnn_conv1d_pad_to_nc1d",
        "do_copy_in_default_stream",
        "enable_cuda_graph",
        "tunable_op_enable",
        "tunable_op_tuning_enable",
        "prefer_nhwc",
        "use_tf32",
        "trt_fp16_enable",
        "trt_bf16_enable",
        "trt_int8_enable",
        "trt_max_workspace_size",
        "trt_builder_optimization_level",
        "trt_max_partition_iterations",
        "trt_min_subgraph_size",
        "trt_force_sequential_engine_build",
        "trt_cuda_graph_enable",
        "trt_layer_norm_fp32_fallback",
        "trt_auxiliary_streams",
        "trt_detailed_build_log",
        "trt_sparsity_enable",
    }
)
"""Provider options a file may set: numbers and switches of the CUDA and TensorRT providers. The
rest can load a library (``trt_extra_plugin_lib_paths``), point at files (cache and profile paths,
which aitune sets itself) or dump a model somewhere, so only the user's own code sets them."""


@attrs.frozen(kw_only=True)
class ONNXRuntimeBackendConfig(BackendConfig):
    """Settings of ONNXRuntimeBackend."""

    execution_provider: ONNXExecutionProvider | None = attrs.field(default=None, converter=_provider)
    """None: CUDA when tuning on a CUDA device, else CPU."""
    graph_optimization_level: str = attrs.field(default="all", validator=_level)
    intra_op_num_threads: int | None = attrs.field(default=None, validator=_threads)
    """None: torch's thread count (one budget for every candidate, eager included); 0: ONNX Runtime's
    own default (every core)."""
    inter_op_num_threads: int | None = attrs.field(default=None, validator=_threads)
    """None: 1 (the session executes sequentially); 0: ONNX Runtime's own default."""
    provider_options: dict[str, str] = attrs.field(factory=dict, converter=_options, hash=False)
    """Passed to the execution provider as they are (e.g. ``{"trt_fp16_enable": "True"}``)."""
    use_io_binding: bool = attrs.field(default=True, validator=_bool)
    """On CUDA/TensorRT: bind torch tensors' device memory, so nothing is copied through the host."""
    export: ONNXExportConfig = attrs.field(factory=ONNXExportConfig, validator=_export)
    save_optimized_model: bool = attrs.field(default=False, validator=_bool)
    """Also save ONNX Runtime's optimized graph so a load skips graph optimization."""
    attention: str | None = attrs.field(default=None, validator=attrs.validators.in_(ATTENTIONS))
    """For a transformers model: the attention implementation to export with (``"eager"``,
    ``"sdpa"``); None exports the model as it is configured. The model is restored afterwards."""
    quantization: str | None = attrs.field(default=None, validator=attrs.validators.in_(QUANTIZATIONS))
    """None, ``"dynamic_int8"`` (int8 weights, activations quantized at run time) or ``"static_int8"``
    (QDQ int8 calibrated on the recorded samples), applied to the exported graph. Quantized
    candidates are checked against eager under their own looser bound (:data:`INT8_TOLERANCE`)."""

    @property
    def tf32(self) -> bool:
        """Whether the provider options turn TF32 on (aitune turns it off by default)."""
        return self.provider_options.get("use_tf32", "0").strip().lower() in {"1", "true"}

    def untrusted_settings(self) -> list[str]:
        return [
            f"provider_options[{key!r}] (not a provider option a file may set)"
            for key in self.provider_options
            if key not in FILE_SAFE_PROVIDER_OPTIONS
        ]
