"""Configurations of the tensorrt backend: frozen attrs, validated, JSON through core's converter."""

from __future__ import annotations

from typing import Literal

import attrs

from aitune.plugin import BackendConfig, ConfigError

Shape = tuple[int, ...]

BUILDER_PRECISION_FLAGS = frozenset({"FP16", "BF16", "INT8", "FP8"})
"""Weak-typing precision flags: TensorRT refuses them on a strongly typed network."""
BUILDER_FLAGS = BUILDER_PRECISION_FLAGS | {"SPARSE_WEIGHTS", "DIRECT_IO", "REFIT"}


def _check_profile_shapes(instance: TensorRTProfile, attribute: attrs.Attribute, value: dict) -> None:
    if not value:
        raise ConfigError("TensorRTProfile(shapes={}): give (min, opt, max) shapes for at least one input")
    for path, triple in value.items():
        if len(triple) != 3:
            raise ConfigError(f"TensorRTProfile: shapes[{path!r}] must be (min, opt, max), got {len(triple)} shapes")
        lo, opt, hi = triple
        if not len(lo) == len(opt) == len(hi):
            raise ConfigError(f"TensorRTProfile: shapes[{path!r}] = {triple}: min, opt and max differ in rank")
        for axis, (a, b, c) in enumerate(zip(lo, opt, hi)):
            if a < 0 or not a <= b <= c:
                raise ConfigError(
                    f"TensorRTProfile: shapes[{path!r}] axis {axis} has min={a}, opt={b}, max={c}; "
                    "each axis needs 0 <= min <= opt <= max"
                )


def _shapes(value: dict) -> dict[str, tuple[Shape, Shape, Shape]]:
    return {str(k): tuple(tuple(int(d) for d in s) for s in v) for k, v in dict(value).items()}  # type: ignore[misc]


@attrs.frozen(kw_only=True)
class TensorRTProfile:
    """One optimisation profile: per input path, the (min, opt, max) shapes TensorRT builds for.

    Several profiles cover disjoint regimes (short and long sequences); inputs left out take the
    graph's ranges, with any named dimension a listed input fixes (sequence length shared by
    ``input_ids`` and ``attention_mask``) carried over.
    """

    shapes: dict[str, tuple[Shape, Shape, Shape]] = attrs.field(converter=_shapes, validator=_check_profile_shapes)


@attrs.frozen(kw_only=True)
class ONNXAutoCastConfig:
    """Cast the ONNX model to fp16/bf16 with ModelOpt's AutoCast before the build.

    AutoCast keeps in fp32 the nodes whose values, measured on the recorded samples, would overflow
    or lose too much in the low precision (``data_max``, ``init_max``).
    """

    kind: Literal["autocast"] = "autocast"
    low_precision_type: Literal["fp16", "bf16"] = attrs.field(
        default="fp16", validator=attrs.validators.in_(("fp16", "bf16"))
    )
    keep_io_types: bool = True
    """Keep the model's input and output dtypes, so the engine is a drop-in for the module."""
    nodes_to_exclude: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Regexes of node names that stay in fp32."""
    op_types_to_exclude: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    data_max: float = attrs.field(default=512.0, validator=attrs.validators.gt(0))
    init_max: float = attrs.field(default=65504.0, validator=attrs.validators.gt(0))
    calibrate_on_samples: bool = True
    """Measure node ranges on the recorded samples instead of random inputs."""


@attrs.frozen(kw_only=True)
class ModelOptQuantizationConfig:
    """Quantize the ONNX model with ModelOpt (Q/DQ nodes), calibrated on every recorded sample."""

    kind: Literal["quantization"] = "quantization"
    mode: Literal["int8", "fp8"] = attrs.field(default="int8", validator=attrs.validators.in_(("int8", "fp8")))
    calibration: Literal["entropy", "max"] = attrs.field(
        default="entropy", validator=attrs.validators.in_(("entropy", "max"))
    )
    high_precision_dtype: Literal["fp32", "fp16", "bf16"] = attrs.field(
        default="fp16", validator=attrs.validators.in_(("fp32", "fp16", "bf16"))
    )
    """Precision of what is not quantized."""
    calibration_providers: tuple[str, ...] = attrs.field(default=("cuda", "cpu"), converter=tuple)
    """ONNX Runtime execution providers for calibration, in order of preference (ModelOpt names);
    a bare ``cuda`` is the device being built for (``cuda:1`` when building on GPU 1)."""
    op_types_to_exclude: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    nodes_to_exclude: tuple[str, ...] = attrs.field(default=(), converter=tuple)


def _check_flags(instance: TensorRTBackendConfig, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    if "STRIP_PLAN" in value:
        raise ConfigError(
            "TensorRTBackendConfig.builder_flags: STRIP_PLAN builds a plan without its weights, which must be refit "
            "from the model before it runs; aitune saves and loads whole plans and does not refit, so leave it out"
        )
    unknown = sorted(set(value) - BUILDER_FLAGS)
    if unknown:
        raise ConfigError(f"TensorRTBackendConfig.builder_flags: unknown {unknown}; known: {sorted(BUILDER_FLAGS)}")


def _check_bytes(instance: TensorRTBackendConfig, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"TensorRTBackendConfig.{attribute.name} is a number of bytes (an int >= 0, e.g. 512 * 2**20), got {value!r}"
        )


@attrs.frozen(kw_only=True)
class TensorRTBackendConfig(BackendConfig):
    """Settings of TensorRTBackend.

    The network is strongly typed by default: the ONNX model's dtypes decide each layer's
    precision, so lower precision comes from ``quantization_config`` (AutoCast or ModelOpt
    quantization), not from builder flags.
    """

    profiles: tuple[TensorRTProfile, ...] = attrs.field(default=(), converter=tuple)
    """Optimisation profiles; empty: one profile from the graph (min/max of the ranges, opt at the most common shape)."""
    quantization_config: ONNXAutoCastConfig | ModelOptQuantizationConfig | None = None
    strongly_typed: bool = True
    builder_flags: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_check_flags)
    """Extra ``trt.BuilderFlag`` names; FP16/BF16/INT8/FP8 need ``strongly_typed=False``."""
    tf32: bool = True
    """Let fp32 matmuls and convolutions use TF32 (TensorRT's default); the tolerance widens to match."""
    workspace_size: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.gt(0)))
    """Bytes of scratch memory the builder may give a layer; None: TensorRT's default (the device's memory)."""
    optimization_level: int = attrs.field(default=3, validator=[attrs.validators.ge(0), attrs.validators.le(5)])
    """Builder optimisation level 0..5: higher searches longer for faster kernels."""
    use_timing_cache: bool = True
    """Keep kernel timings in aitune's cache dir and reuse them, so a rebuild on this machine is faster."""
    use_cuda_graphs: bool = False
    """Capture one CUDA graph per input shape and replay it (outputs are then copied out of the graph's buffers)."""
    cuda_graph_memory: int = attrs.field(default=1 << 30, validator=_check_bytes)
    """Bytes the kept CUDA graphs may hold (default 1 GiB): each graph's static input and output
    buffers, and at least 1 MiB per graph for its context and executable graph. A shape whose graph
    does not fit runs without one, unless it is called more than twice as often as the graphs it
    would replace. Activation memory is not counted here: every context shares one block of it."""
    hardware_compatible: bool = False
    """Build for every GPU from Ampere on (slower engine) instead of this compute capability only."""
    version_compatible: bool = False
    """Build a plan that later TensorRT releases of the same major version can run."""
    onnx_exporter: Literal["dynamo", "torchscript"] = attrs.field(
        default="dynamo", validator=attrs.validators.in_(("dynamo", "torchscript"))
    )
    onnx_opset: int | None = None

    def __attrs_post_init__(self) -> None:
        weak = sorted(BUILDER_PRECISION_FLAGS & set(self.builder_flags))
        if weak and self.strongly_typed:
            raise ConfigError(
                f"TensorRTBackendConfig: builder_flags {weak} only apply to weakly typed networks; set "
                "strongly_typed=False, or keep strong typing and use quantization_config=ONNXAutoCastConfig(...) "
                "or ModelOptQuantizationConfig(...)"
            )
