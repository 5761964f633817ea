"""The check after every build that the engine computes in the precision asked for (no GPU needed).

The inspector JSON here has the layout TensorRT writes with ``ProfilingVerbosity.DETAILED``: per
layer its type and each input's and output's ``Format/Datatype``.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch

from aitune_backend_tensorrt.config import ModelOptQuantizationConfig, ONNXAutoCastConfig, TensorRTBackendConfig
from aitune_backend_tensorrt.layers import (
    MIN_SHARE,
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
    assert precision_problem(None, [names_only]) is None, "nothing asked: nothing to check"
    problem = precision_problem("fp16", [names_only])
    assert problem and "cannot be checked" in problem and "no layer formats" in problem


def test_an_inspector_that_fails_fails_a_build_that_asked_for_a_lower_precision():
    problem = precision_problem("int8", [], "the engine inspector failed (RuntimeError: boom)")
    assert problem and "cannot be checked: the engine inspector failed (RuntimeError: boom)" in problem
    assert precision_problem(None, [], "the engine inspector failed") is None


def test_an_fp16_request_that_built_fp32_fails_and_says_what_it_got():
    problem = precision_problem("fp16", [FP32_ENGINE])
    assert problem is not None
    assert "asked for fp16" in problem and "only 0 of its 2 compute layers" in problem
    assert "{'fp32': 2}" in problem and "quantization_config" in problem


def test_a_request_honoured_or_no_request_passes():
    half = _engine(_layer("CaskConvolution", ["Half"], ["Half"]))
    assert precision_problem("fp16", [half]) is None
    assert precision_problem(None, [FP32_ENGINE]) is None


def test_one_cast_in_the_requested_precision_does_not_make_an_fp16_engine():
    cast_only = _engine(
        _layer("Cast", ["Float"], ["Half"]),
        _layer("CaskConvolution", ["Float"], ["Float"]),
        _layer("CaskGemmMatrixMultiply", ["Float"], ["Float"]),
        _layer("kgen", ["Float"], ["Float"]) | {"Name": "__myl_MhaSoftmax_myl0_3"},
    )
    problem = precision_problem("fp16", [cast_only])
    assert problem and "only 0 of its 3 compute layers" in problem, "the Cast layer is not compute"
    mostly = _engine(
        _layer("CaskConvolution", ["Half"], ["Half"]),
        _layer("CaskGemmMatrixMultiply", ["Half"], ["Half"]),
        _layer("gemm", ["Float"], ["Float"]),  # one kept in fp32 by AutoCast's data range rule
    )
    assert precision_problem("fp16", [mostly]) is None, f"2 of 3 is over {MIN_SHARE:.0%}"
    elementwise = _engine(_layer("PointWiseV2", ["Half"], ["Half"]))
    assert precision_problem("fp16", [elementwise]) is None, "no compute layer: any layer in fp16 will do"


def test_every_profile_must_compute_in_the_requested_precision():
    half = _engine(_layer("CaskConvolution", ["Half"], ["Half"]))
    problem = precision_problem("fp16", [half, FP32_ENGINE])
    assert problem and "in profile 1 only 0 of its 2" in problem
    assert precision_problem("fp16", [half, half]) is None


def test_the_requested_precision_comes_from_the_lowering_config():
    assert requested_precision(TensorRTBackendConfig()) is None
    autocast = ONNXAutoCastConfig(low_precision_type="bf16")
    assert requested_precision(TensorRTBackendConfig(quantization_config=autocast)) == "bf16"
    quantized = ModelOptQuantizationConfig(mode="fp8")
    assert requested_precision(TensorRTBackendConfig(quantization_config=quantized)) == "fp8"


def test_each_profile_is_inspected_with_its_opt_shapes_set(monkeypatch):
    """With dynamic shapes the engine alone reports "N/A": the inspector gets a context on each
    profile in turn, its inputs set to that profile's opt shapes."""
    log: list = []

    class Context:
        def __init__(self):
            self.profile = 0

        def set_optimization_profile_async(self, index, stream):
            log.append(("profile", index, stream))
            self.profile = index
            return True

        def set_input_shape(self, name, shape):
            log.append(("shape", self.profile, name, shape))
            return True

    class Inspector:
        execution_context = None

        def get_engine_information(self, fmt):
            log.append(("describe", self.execution_context.profile, fmt))
            return FP32_ENGINE

    engine = SimpleNamespace(
        create_engine_inspector=Inspector, create_execution_context=Context, num_optimization_profiles=2
    )

    class Runtime:
        engine_host_code_allowed = False

        def __init__(self, logger):
            log.append(("runtime", self))

        def deserialize_cuda_engine(self, plan):
            return engine

    trt = SimpleNamespace(
        Runtime=Runtime,
        Logger=lambda level: None,
        LayerInformationFormat=SimpleNamespace(JSON="json"),
    )
    trt.Logger.WARNING = 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    stream = SimpleNamespace(cuda_stream=5, synchronize=lambda: log.append(("synchronize",)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    profiles = [[("x", (4, 3, 16, 16))], [("x", (32, 3, 16, 16))], [("x", (64, 3, 16, 16))]]
    described = plan_information(b"plan", profiles, version_compatible=True)
    assert described == [FP32_ENGINE, FP32_ENGINE], "one description per profile the engine has"
    assert log[0][1].engine_host_code_allowed is True
    assert log[1:] == [
        ("shape", 0, "x", (4, 3, 16, 16)),
        ("describe", 0, "json"),
        ("profile", 1, 5),
        ("synchronize",),
        ("shape", 1, "x", (32, 3, 16, 16)),
        ("describe", 1, "json"),
    ]


@pytest.mark.parametrize("broken", ["{not json", "[]", json.dumps({"Layers": [42, None]})])
def test_unreadable_information_counts_nothing_rather_than_crashing_the_build(broken):
    assert layer_precisions(broken) == {}
