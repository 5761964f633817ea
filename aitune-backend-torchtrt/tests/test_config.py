"""TorchTensorRTConfig: validation, JSON, and its mapping onto Torch-TensorRT's compile settings."""

from __future__ import annotations

import json

import pytest
import torch

from aitune.errors import ConfigError
from aitune.testing import config_from_json, config_to_json
from aitune.validation import DEFAULT_TOLERANCES
from aitune_backend_torchtrt.backend import TorchTensorRTAotBackend, TorchTensorRTJitBackend
from aitune_backend_torchtrt.config import (
    TorchTensorRTAotBackendConfig,
    TorchTensorRTConfig,
    TorchTensorRTJitBackendConfig,
    to_torch_tensorrt_kwargs,
)


def test_defaults_map_to_torch_tensorrt_defaults_with_tf32_off() -> None:
    common = {
        "workspace_size": 0,
        "min_block_size": 5,
        "truncate_double": False,
        "require_full_compilation": False,
        "torch_executed_ops": set(),
        "sparse_weights": False,
        "hardware_compatible": False,
        "version_compatible": False,
        "disable_tf32": True,
    }
    assert to_torch_tensorrt_kwargs(TorchTensorRTConfig(), "2.12.1") == {
        **common,
        "enabled_precisions": {torch.float32},
        "use_python_runtime": False,
    }, "settings newer releases add are passed only when switched on"
    assert to_torch_tensorrt_kwargs(TorchTensorRTConfig(), "2.13.0+cu130") == common, (
        "2.13 removed enabled_precisions, use_explicit_typing and use_python_runtime"
    )


def test_every_setting_reaches_the_kwargs_before_2_13() -> None:
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
        tf32=True,
    )
    kwargs = to_torch_tensorrt_kwargs(config, "2.9.0")
    assert kwargs["enabled_precisions"] == {torch.float16, torch.bfloat16, torch.float32}
    assert kwargs["workspace_size"] == 1 << 30 and kwargs["min_block_size"] == 2
    assert kwargs["optimization_level"] == 5 and kwargs["disable_tf32"] is False
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
    assert "enable_autocast" not in kwargs


@pytest.mark.parametrize(("precisions", "dtype"), [(("fp16", "fp32"), torch.float16), (("bf16",), torch.bfloat16)])
def test_from_2_13_lower_precision_autocasts_the_graph(precisions, dtype) -> None:
    kwargs = to_torch_tensorrt_kwargs(
        TorchTensorRTConfig(enabled_precisions=precisions, use_explicit_typing=True), "2.13.0"
    )
    assert kwargs["enable_autocast"] is True and kwargs["autocast_low_precision_type"] is dtype
    assert not {"enabled_precisions", "use_explicit_typing", "use_python_runtime"} & set(kwargs)


def test_from_2_13_the_removed_python_runtime_is_refused_by_name() -> None:
    config = TorchTensorRTConfig(use_python_runtime=True)
    with pytest.raises(ConfigError, match=r"torch-tensorrt 2\.14\.0 removed the Python runtime option"):
        to_torch_tensorrt_kwargs(config, "2.14.0")


def test_settings_the_release_does_not_know_are_refused_not_swallowed(make_release_settings) -> None:
    from types import SimpleNamespace

    from aitune.errors import BuildError
    from aitune_backend_torchtrt.backend import compile_settings

    Settings = make_release_settings()  # a 2.13-like release that lacks autocast
    release = SimpleNamespace(__version__="2.13.0", dynamo=SimpleNamespace(CompilationSettings=Settings))
    assert compile_settings(release, TorchTensorRTConfig())["disable_tf32"] is True
    with pytest.raises(
        BuildError, match=r"does not know the compile settings \['autocast_low_precision_type', 'enable_autocast'\]"
    ):
        compile_settings(release, TorchTensorRTConfig(enabled_precisions=("fp16",)))
    unreadable = SimpleNamespace(__version__="2.13.0", dynamo=SimpleNamespace())
    assert "enable_autocast" in compile_settings(unreadable, TorchTensorRTConfig(enabled_precisions=("fp16",)))


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
    assert TorchTensorRTAotBackend().tolerance(torch.float32) is None, "fp32 runs without TF32 by default"
    tf32 = TorchTensorRTAotBackend(TorchTensorRTAotBackendConfig(compile_config=TorchTensorRTConfig(tf32=True)))
    assert tf32.tolerance(torch.float32).atol > DEFAULT_TOLERANCES["float32"].atol, "TF32 declares its wider bound"


def test_the_jit_path_raises_build_failures_instead_of_running_eager() -> None:
    """Without pass_through_build_failures torch.compile hands back the original graph: eager under a TensorRT name."""
    for version in ("2.9.0", "2.12.1", "2.13.0"):
        assert to_torch_tensorrt_kwargs(TorchTensorRTConfig(), version, jit=True)["pass_through_build_failures"] is True
        assert "pass_through_build_failures" not in to_torch_tensorrt_kwargs(TorchTensorRTConfig(), version)


@pytest.mark.parametrize("version", ["2.10.0", "2.11.0+cu130", "2.12.1"])
def test_fp16_on_2_10_to_2_12_turns_explicit_typing_off_so_the_fp16_flag_is_set(version) -> None:
    fp16 = TorchTensorRTConfig(enabled_precisions=("fp16", "fp32"))
    assert to_torch_tensorrt_kwargs(fp16, version)["use_explicit_typing"] is False
    assert "use_explicit_typing" not in to_torch_tensorrt_kwargs(TorchTensorRTConfig(), version), "fp32 leaves it alone"
    assert "use_explicit_typing" not in to_torch_tensorrt_kwargs(fp16, "2.9.0"), "before 2.10 it defaulted to False"
    explicit = TorchTensorRTConfig(enabled_precisions=("fp16",), use_explicit_typing=True)
    assert to_torch_tensorrt_kwargs(explicit, version)["use_explicit_typing"] is True, "the user's choice wins"


def test_from_2_13_lower_precision_through_torch_compile_is_refused_not_built_fp32() -> None:
    fp16 = TorchTensorRTConfig(enabled_precisions=("fp16",))
    with pytest.raises(ConfigError, match="TorchTensorRTAotBackend for lower precision"):
        to_torch_tensorrt_kwargs(fp16, "2.13.0", jit=True)
    assert to_torch_tensorrt_kwargs(fp16, "2.13.0")["enable_autocast"] is True, "the AOT path autocasts"
    assert "enable_autocast" not in to_torch_tensorrt_kwargs(TorchTensorRTConfig(), "2.14.0", jit=True)
