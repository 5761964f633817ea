"""What precision the built engine really computes in, read from TensorRT's engine inspector.

A lower precision asked for (AutoCast fp16/bf16, int8/fp8 quantization) is a property of the ONNX
model the engine is built from; nothing but the engine says whether TensorRT honoured it. The
builder keeps detailed layer information (``ProfilingVerbosity.DETAILED``), and after every build
the inspector, given an execution context whose shapes are set (with dynamic shapes the engine alone
reports "N/A"), lists each layer's input and output formats, once per optimisation profile (each
profile is its own set of kernels). A build that asked for fp16 fails, instead of passing under
the fp16 label, unless in every profile at least :data:`MIN_SHARE` of the compute layers (matrix
products, convolutions, attention) read or write fp16; and, since the check is what stands
behind the label, when the inspector fails or reports no formats.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from .config import ModelOptQuantizationConfig, ONNXAutoCastConfig, Shape, TensorRTBackendConfig

BOOKKEEPING_LAYERS = frozenset({"Reformat", "NoOp", "Constant", "Shuffle", "Identity"})
"""Layers that move or relabel data: a reformat into fp16 computes nothing in fp16."""
COMPUTE_WORDS = ("convolution", "gemm", "matrixmultiply", "matmul", "attention", "mha")
"""Words of the ``LayerType`` (``CaskConvolution``, ``CaskGemmMatrixMultiply``, ``gemm``,
``MatrixMultiply``, ...) or, for a Myelin ``kgen`` layer, of its name or tactic, that mark the
layers doing a model's arithmetic."""
MIN_SHARE = 0.5
"""The share of compute layers that must touch the requested precision, in every profile: one Cast
or a few layers in fp16 do not make an fp16 engine."""

_FORMAT_WORDS = (  # checked in order: "BFLOAT16" also contains "FLOAT"
    ("fp8", ("FP8", "E4M3")),
    ("int8", ("INT8",)),
    ("bf16", ("BF16", "BFLOAT16")),
    ("fp16", ("FP16", "HALF")),
    ("fp32", ("FP32", "FLOAT")),
)


def requested_precision(config: TensorRTBackendConfig) -> str | None:
    """The lower precision the config asks for (``fp16``, ``bf16``, ``int8``, ``fp8``), or None."""
    quantization = config.quantization_config
    if isinstance(quantization, ONNXAutoCastConfig):
        return quantization.low_precision_type
    if isinstance(quantization, ModelOptQuantizationConfig):
        return quantization.mode
    return None


def format_precision(text: str) -> str | None:
    """``"Row major linear FP16 format"`` -> ``"fp16"``; None for integer, bool or unknown formats."""
    upper = text.upper()
    for precision, words in _FORMAT_WORDS:
        if any(word in upper for word in words):
            return precision
    return None


def layer_precisions(information: str) -> dict[str, int]:
    """Per precision, how many compute layers read or write a tensor in it; empty if not detailed.

    ``information`` is the inspector's JSON (``LayerInformationFormat.JSON``). An engine built
    without detailed verbosity lists layer names only, and gives an empty count.
    """
    try:
        layers = json.loads(information).get("Layers", [])
    except (ValueError, AttributeError):
        return {}
    counts: dict[str, int] = {}
    for layer in layers:
        if not isinstance(layer, dict) or layer.get("LayerType") in BOOKKEEPING_LAYERS:
            continue
        tensors = [*layer.get("Inputs", ()), *layer.get("Outputs", ())]
        found = {format_precision(str(t.get("Format/Datatype", ""))) for t in tensors if isinstance(t, dict)}
        for precision in found:
            if precision is not None:
                counts[precision] = counts.get(precision, 0) + 1
    return dict(sorted(counts.items()))


def is_compute_layer(layer: dict) -> bool:
    """A matrix product, convolution or attention layer (:data:`COMPUTE_WORDS`)."""
    kind = str(layer.get("LayerType", "")).lower()
    if kind == "kgen":
        kind = f"{layer.get('Name', '')} {layer.get('TacticName', '')}".lower()
    return any(word in kind for word in COMPUTE_WORDS)


def compute_share(information: str, precision: str) -> tuple[int, int]:
    """(compute layers touching ``precision``, compute layers) in one profile's inspector JSON."""
    try:
        layers = json.loads(information).get("Layers", [])
    except (ValueError, AttributeError):
        return 0, 0
    compute = [layer for layer in layers if isinstance(layer, dict) and is_compute_layer(layer)]
    touching = 0
    for layer in compute:
        tensors = [*layer.get("Inputs", ()), *layer.get("Outputs", ())]
        found = {format_precision(str(t.get("Format/Datatype", ""))) for t in tensors if isinstance(t, dict)}
        touching += precision in found
    return touching, len(compute)


def precision_problem(requested: str | None, profiles: Sequence[str], failure: str | None = None) -> str | None:
    """Why the engine, described by the inspector's JSON of each profile, does not compute in
    ``requested``; None when it does or nothing was asked. ``failure``: why there is no description."""
    if requested is None:
        return None
    fix = "check the ONNX model's types after AutoCast/quantization, or drop quantization_config"
    counts = [layer_precisions(info) for info in profiles]
    if failure or not profiles or not all(counts):
        why = failure or "the engine inspector reported no layer formats (the plan lacks detailed layer information)"
        return f"the engine was asked for {requested} but whether it computes in it cannot be checked: {why}; {fix}"
    for index, (info, count) in enumerate(zip(profiles, counts)):
        touching, total = compute_share(info, requested)
        if total == 0:  # no matrix product, convolution or attention: any compute layer in it will do
            touching, total = (1 if count.get(requested, 0) else 0), 1
        if touching < MIN_SHARE * total:
            return (
                f"the engine was asked for {requested} but in profile {index} only {touching} of its {total} compute "
                f"layers (matrix products, convolutions, attention) read or write {requested}, under the "
                f"{MIN_SHARE:.0%} required (layers by precision: {count}); TensorRT kept the graph in higher "
                f"precision, so it would run under a {requested} label without being {requested}: {fix}"
            )
    return None


def plan_information(
    plan: bytes, profiles: Sequence[Sequence[tuple[str, Shape]]], version_compatible: bool = False
) -> list[str]:
    """The inspector's JSON for a freshly built ``plan``, once per optimisation profile, with an
    execution context on that profile and its inputs set to the profile's opt shapes (``profiles``);
    an empty string for a profile TensorRT cannot describe. Runs on the current CUDA device."""
    import tensorrt as trt
    import torch

    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    if version_compatible:  # such a plan embeds its own lean runtime, which must be allowed to run
        runtime.engine_host_code_allowed = True
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        return [""]
    described = []
    for index, shapes in enumerate(profiles[: engine.num_optimization_profiles]):
        inspector = engine.create_engine_inspector()
        context = engine.create_execution_context()
        if inspector is None or context is None:
            described.append("")
            continue
        if index:
            stream = torch.cuda.current_stream()
            if not context.set_optimization_profile_async(index, stream.cuda_stream):
                described.append("")
                continue
            stream.synchronize()
        for name, shape in shapes:
            context.set_input_shape(name, shape)
        inspector.execution_context = context
        described.append(str(inspector.get_engine_information(trt.LayerInformationFormat.JSON) or ""))
    return described
