"""What precision the built engine really computes in, read from TensorRT's engine inspector.

A lower precision asked for (AutoCast fp16/bf16, int8/fp8 quantization) is a property of the ONNX
model the engine is built from; nothing but the engine says whether TensorRT honoured it. The
builder keeps detailed layer information (``ProfilingVerbosity.DETAILED``), and after every build
the inspector, given an execution context whose shapes are set (with dynamic shapes the engine alone
reports "N/A"), lists each layer's input and output formats. A build that asked for fp16 and has no
compute layer touching fp16 fails instead of passing under the fp16 label.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from .config import ModelOptQuantizationConfig, ONNXAutoCastConfig, Shape, TensorRTBackendConfig

BOOKKEEPING_LAYERS = frozenset({"Reformat", "NoOp", "Constant", "Shuffle", "Identity"})
"""Layers that move or relabel data: a reformat into fp16 computes nothing in fp16."""

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


def precision_problem(requested: str | None, counts: dict[str, int]) -> str | None:
    """Why the engine does not compute in ``requested``; None when it does or nothing was asked."""
    if requested is None or not counts:
        return None
    if counts.get(requested, 0) == 0:
        return (
            f"the engine was asked for {requested} but none of its compute layers reads or writes {requested} "
            f"(layers by precision: {counts}); TensorRT kept the graph in higher precision, so it would run "
            f"under a {requested} label without being {requested}: check the ONNX model's types after "
            "AutoCast/quantization, or drop quantization_config"
        )
    return None


def plan_information(plan: bytes, shapes: Sequence[tuple[str, Shape]], version_compatible: bool = False) -> str:
    """The inspector's JSON for a freshly built ``plan``, its inputs set to ``shapes`` (the first
    profile's opt shapes); an empty string when TensorRT cannot say. Runs on the current CUDA device."""
    import tensorrt as trt

    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    if version_compatible:  # such a plan embeds its own lean runtime, which must be allowed to run
        runtime.engine_host_code_allowed = True
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        return ""
    inspector = engine.create_engine_inspector()
    context = engine.create_execution_context()
    if inspector is None or context is None:
        return ""
    for name, shape in shapes:
        context.set_input_shape(name, shape)
    inspector.execution_context = context
    return str(inspector.get_engine_information(trt.LayerInformationFormat.JSON) or "")
