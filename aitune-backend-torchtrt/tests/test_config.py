"""TorchTensorRTConfig: validation, JSON, and its mapping onto Torch-TensorRT's compile settings."""

from __future__ import annotations

import json

import pytest
import torch

from aitune.errors import ConfigError
from aitune.plugins import config_from_json, config_to_json
from aitune.validation import DEFAULT_TOLERANCES
from aitune_backend_torchtrt.backend import TorchTensorRTAotBackend, TorchTensorRTJitBackend
from aitune_backend_torchtrt.config import (
    TorchTensorRTAotBackendConfig,
    TorchTensorRTConfig,
    TorchTensorRTJitBackendConfig,
    to_torch_tensorrt_kwargs,
)


def test_defaults_map_to_torch_tensorrt_defaults() -> None:
    kwargs = to_torch_tensorrt_kwargs(TorchTensorRTConfig())
    assert kwargs == {
        "enabled_precisions": {torch.float32},
        "workspace_size": 0,
        "min_block_size": 5,
        "truncate_double": False,
        "use_python_runtime": False,
        "require_full_compilation": False,
        "torch_executed_ops": set(),
        "sparse_weights": False,
        "hardware_compatible": False,
        "version_compatible": False,
    }, "settings newer releases add are passed only when switched on"


def test_every_setting_reaches_the_kwargs() -> None:
    config = TorchTensorRTConfig(
        enabled_precisions=("fp16", "bf16", "fp32"),
        workspace_size=1 << 30,
        min_block_size=2,
        optimization_level=5,
        truncate_double=True,
        use_python_runtime=True,
        require_full_compilation=True,
        torch_executed_ops=["torch.ops.aten.softmax.int"],
        sparse_weights=True,
        hardware_compatible=True,
        version_compatible=True,
        use_fp32_acc=True,
        use_explicit_typing=True,
    )
    kwargs = to_torch_tensorrt_kwargs(config)
    assert kwargs["enabled_precisions"] == {torch.float16, torch.bfloat16, torch.float32}
    assert kwargs["workspace_size"] == 1 << 30 and kwargs["min_block_size"] == 2
    assert kwargs["optimization_level"] == 5
    assert kwargs["torch_executed_ops"] == {"torch.ops.aten.softmax.int"}
    for flag in (
        "truncate_double",
        "use_python_runtime",
        "require_full_compilation",
        "sparse_weights",
        "hardware_compatible",
        "version_compatible",
        "use_fp32_acc",
        "use_explicit_typing",
    ):
        assert kwargs[flag] is True, flag


def test_a_single_precision_string_is_accepted() -> None:
    assert TorchTensorRTConfig(enabled_precisions="fp16").enabled_precisions == ("fp16",)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"enabled_precisions": ("fp8",)}, "unknown precision"),
        ({"enabled_precisions": ()}, "at least one"),
        ({"optimization_level": 6}, "optimization_level"),
        ({"min_block_size": 0}, "min_block_size"),
        ({"workspace_size": -1}, "workspace_size"),
        ({"truncate_double": "yes"}, "truncate_double"),
    ],
)
def test_invalid_settings_are_refused(fields: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        TorchTensorRTConfig(**fields)


def test_aot_refuses_the_python_runtime_it_cannot_save() -> None:
    with pytest.raises(ValueError, match="use_python_runtime=False"):
        TorchTensorRTAotBackendConfig(compile_config=TorchTensorRTConfig(use_python_runtime=True))
    TorchTensorRTJitBackendConfig(compile_config=TorchTensorRTConfig(use_python_runtime=True))


def test_a_non_default_config_survives_json() -> None:
    config = TorchTensorRTAotBackendConfig(
        compile_config=TorchTensorRTConfig(
            enabled_precisions=("fp16", "fp32"), optimization_level=3, torch_executed_ops=("torch.ops.aten.add.Tensor",)
        )
    )
    data = json.loads(json.dumps(config_to_json(config)))
    assert data["compile_config"]["enabled_precisions"] == ["fp16", "fp32"]
    assert config_from_json(data) == config


def test_json_with_a_bad_value_names_the_path() -> None:
    data = config_to_json(TorchTensorRTJitBackendConfig())
    data["compile_config"]["enabled_precisions"] = ["fp64"]
    with pytest.raises(ConfigError, match="compile_config"):
        config_from_json(data)


def test_public_names_resolve_through_aitune_torch_backend() -> None:
    from aitune.torch.backend import TorchTensorRTAotBackend as Aot
    from aitune.torch.backend import TorchTensorRTConfig as Exported

    assert Exported is TorchTensorRTConfig and Aot is TorchTensorRTAotBackend


def test_reduced_precision_loosens_the_fp32_bound() -> None:
    fp16 = TorchTensorRTJitBackend(
        TorchTensorRTJitBackendConfig(compile_config=TorchTensorRTConfig(enabled_precisions=("fp16", "fp32")))
    )
    assert fp16.tolerance(torch.float32) == DEFAULT_TOLERANCES["float16"]
    assert fp16.tolerance(torch.float16) is None, "fp16 outputs keep the fp16 default"
    assert TorchTensorRTAotBackend().tolerance(torch.float32) is None
