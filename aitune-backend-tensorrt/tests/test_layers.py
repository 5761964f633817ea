"""The check after every build that the engine computes in the precision asked for (no GPU needed).

The inspector JSON here has the layout TensorRT writes with ``ProfilingVerbosity.DETAILED``: per
layer its type and each input's and output's ``Format/Datatype``.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from aitune_backend_tensorrt.config import ModelOptQuantizationConfig, ONNXAutoCastConfig, TensorRTBackendConfig
from aitune_backend_tensorrt.layers import (
    format_precision,
    layer_precisions,
    plan_information,
    precision_problem,
    requested_precision,
)


def _layer(kind: str, inputs: list[str], outputs: list[str]) -> dict:
    return {
        "Name": f"{kind} layer",
        "LayerType": kind,
        "Inputs": [{"Name": f"in{i}", "Format/Datatype": f} for i, f in enumerate(inputs)],
        "Outputs": [{"Name": f"out{i}", "Format/Datatype": f} for i, f in enumerate(outputs)],
    }


def _engine(*layers: dict) -> str:
    return json.dumps({"Layers": list(layers), "Bindings": ["x", "y"]})


FP32_ENGINE = _engine(
    _layer("CaskConvolution", ["Row major linear FP32"], ["Row major linear FP32"]),
    _layer("Reformat", ["Row major linear FP32"], ["Row major linear FP16 format"]),  # moves data, computes nothing
    _layer("CaskGemmMatrixMultiply", ["Float"], ["Float"]),
)


def test_formats_map_to_precisions_bf16_before_its_float_substring():
    assert format_precision("Row major linear FP16 format") == "fp16"
    assert format_precision("Half") == "fp16"
    assert format_precision("Row major linear BFloat16 format") == "bf16"
    assert format_precision("Thirty-two wide channel vectorized row major Int8 format.") == "int8"
    assert format_precision("Row major linear FP8 format") == "fp8"
    assert format_precision("Float") == "fp32"
    assert format_precision("Row major linear Int32") is None
    assert format_precision("N/A due to dynamic shapes") is None


def test_compute_layers_are_counted_by_the_precisions_they_touch_reformats_are_not():
    mixed = _engine(
        _layer("CaskConvolution", ["Row major linear FP16 format"], ["Row major linear FP16 format"]),
        _layer("CaskConvolution", ["Thirty-two wide channel vectorized row major Int8 format."], ["Float"]),
        _layer("Reformat", ["Float"], ["Half"]),
        _layer("Softmax", ["Float"], ["Float"]),
    )
    assert layer_precisions(mixed) == {"fp16": 1, "fp32": 2, "int8": 1}
    assert layer_precisions(FP32_ENGINE) == {"fp32": 2}


def test_an_engine_without_detailed_layer_information_gives_no_counts():
    names_only = json.dumps({"Layers": ["conv1 + relu1", "fc"], "Bindings": ["x", "y"]})
    assert layer_precisions(names_only) == {}
    assert layer_precisions("") == {}
    assert precision_problem("fp16", {}) is None  # nothing to judge by: the bound against eager still applies


def test_an_fp16_request_that_built_fp32_fails_and_says_what_it_got():
    problem = precision_problem("fp16", layer_precisions(FP32_ENGINE))
    assert problem is not None
    assert "asked for fp16" in problem and "{'fp32': 2}" in problem and "quantization_config" in problem


def test_a_request_honoured_or_no_request_passes():
    half = _engine(_layer("CaskConvolution", ["Half"], ["Half"]))
    assert precision_problem("fp16", layer_precisions(half)) is None
    assert precision_problem(None, layer_precisions(FP32_ENGINE)) is None


def test_the_requested_precision_comes_from_the_lowering_config():
    assert requested_precision(TensorRTBackendConfig()) is None
    autocast = ONNXAutoCastConfig(low_precision_type="bf16")
    assert requested_precision(TensorRTBackendConfig(quantization_config=autocast)) == "bf16"
    quantized = ModelOptQuantizationConfig(mode="fp8")
    assert requested_precision(TensorRTBackendConfig(quantization_config=quantized)) == "fp8"


def test_the_plan_is_inspected_with_the_profiles_opt_shapes_set(monkeypatch):
    """With dynamic shapes the engine alone reports "N/A": the inspector gets a context with shapes."""
    seen: dict = {}

    class Context:
        def set_input_shape(self, name, shape):
            seen.setdefault("shapes", []).append((name, shape))
            return True

    class Inspector:
        execution_context = None

        def get_engine_information(self, fmt):
            seen["context_shapes"] = list(seen.get("shapes", [])) if self.execution_context else None
            seen["format"] = fmt
            return FP32_ENGINE

    engine = SimpleNamespace(create_engine_inspector=Inspector, create_execution_context=Context)

    class Runtime:
        engine_host_code_allowed = False

        def __init__(self, logger):
            seen["runtime"] = self

        def deserialize_cuda_engine(self, plan):
            seen["plan"] = plan
            return engine

    trt = SimpleNamespace(
        Runtime=Runtime,
        Logger=lambda level: None,
        LayerInformationFormat=SimpleNamespace(JSON="json"),
    )
    trt.Logger.WARNING = 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    text = plan_information(b"plan", [("x", (4, 3, 16, 16))], version_compatible=True)
    assert text == FP32_ENGINE and seen["plan"] == b"plan" and seen["format"] == "json"
    assert seen["context_shapes"] == [("x", (4, 3, 16, 16))]
    assert seen["runtime"].engine_host_code_allowed is True


@pytest.mark.parametrize("broken", ["{not json", "[]", json.dumps({"Layers": [42, None]})])
def test_unreadable_information_counts_nothing_rather_than_crashing_the_build(broken):
    assert layer_precisions(broken) == {}
