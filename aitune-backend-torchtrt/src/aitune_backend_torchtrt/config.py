"""Configurations of the Torch-TensorRT backends, and their mapping onto Torch-TensorRT's settings.

Everything here works without torch_tensorrt installed: configs are plain attrs data (JSON through
aitune's converter) and :func:`to_torch_tensorrt_kwargs` only needs torch's dtypes.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from aitune.plugin import BackendConfig, BuildError, ConfigError

PRECISIONS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
"""Precision names a config accepts, and the torch dtype Torch-TensorRT receives for each."""


def _precisions(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    return tuple(value)


def _check_precisions(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    if not value:
        raise ValueError(f"{attribute.name} must name at least one precision, e.g. ('fp32',)")
    unknown = [p for p in value if p not in PRECISIONS]
    if unknown:
        raise ValueError(f"{attribute.name}: unknown precision {unknown}; choose from {sorted(PRECISIONS)}")


_str_tuple = attrs.validators.deep_iterable(attrs.validators.instance_of(str), attrs.validators.instance_of(tuple))


@attrs.frozen(kw_only=True)
class TorchTensorRTConfig:
    """Torch-TensorRT compilation settings shared by the JIT and AOT backends.

    Each field maps onto the Torch-TensorRT setting of the same name; defaults are Torch-TensorRT's.
    """

    enabled_precisions: tuple[str, ...] = attrs.field(
        default=("fp32",), converter=_precisions, validator=_check_precisions
    )
    """Kernel precisions TensorRT may choose from: "fp32", "fp16", "bf16"."""
    workspace_size: int = attrs.field(default=0, validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)])
    """Bytes of scratch memory TensorRT may use while building (0: TensorRT's own limit)."""
    min_block_size: int = attrs.field(default=5, validator=[attrs.validators.instance_of(int), attrs.validators.ge(1)])
    """Fewest consecutive convertible operators worth a TensorRT engine; smaller runs stay in PyTorch."""
    optimization_level: int | None = attrs.field(
        default=None,
        validator=attrs.validators.optional([attrs.validators.ge(0), attrs.validators.le(5)]),
    )
    """TensorRT builder optimisation level 0-5 (higher builds longer, may run faster); None: TensorRT's."""
    truncate_double: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Run float64 tensors as float32 inside TensorRT (which has no float64 kernels)."""
    use_python_runtime: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Run engines through TensorRT's Python API instead of Torch-TensorRT's C++ runtime."""
    require_full_compilation: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Fail instead of leaving unsupported operators in PyTorch."""
    torch_executed_ops: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_str_tuple)
    """Operators to keep in PyTorch by qualified name, e.g. "torch.ops.aten.softmax.int"."""
    sparse_weights: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Let TensorRT use structured-sparsity kernels for weights that allow them."""
    hardware_compatible: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Build engines that run on every Ampere-or-newer GPU, not only the one they were built on."""
    version_compatible: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Build engines that later TensorRT versions can run."""
    use_fp32_acc: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Accumulate fp16 matmuls in fp32 (passed only when True; needs a release that knows it)."""
    use_explicit_typing: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Keep the model's own dtypes per layer (before 2.13; from 2.13 every engine is typed this way)."""
    tf32: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """Let fp32 layers run in TF32 (faster on Ampere and later, about 1e-3 relative error); off by
    default (``disable_tf32=True``) so fp32 engines meet the fp32 bound. On, the bound widens to TF32's."""

    @property
    def lowest_precision(self) -> torch.dtype:
        """The least precise dtype TensorRT may compute in, which bounds the expected error."""
        for name in ("fp16", "bf16", "fp32"):
            if name in self.enabled_precisions:
                return PRECISIONS[name]
        return torch.float32


def to_torch_tensorrt_kwargs(
    config: TorchTensorRTConfig, torch_tensorrt_version: str, jit: bool = False
) -> dict[str, Any]:
    """The keyword arguments of ``torch_tensorrt.dynamo.compile`` (and ``torch.compile`` options)
    for the installed Torch-TensorRT release.

    Before 2.13 lower precision is ``enabled_precisions``; from 2.13 that setting is gone (a
    strongly typed engine takes its precision from the graph's dtypes), so fp16/bf16 become
    Torch-TensorRT's autocast of the graph to that type. Settings that only newer releases know are
    passed only when switched on, so a default config works with every supported release.

    ``jit``: the settings go to ``torch.compile(backend="torch_tensorrt")``. A build failure there
    must raise (``pass_through_build_failures``), or the backend hands back the original graph and
    the candidate runs eager under a TensorRT name; and from 2.13 autocast runs only in the
    ahead-of-time path, so lower precision through ``torch.compile`` is refused rather than built fp32.
    """
    from .versions import EXPLICIT_TYPING_DEFAULT_FROM, STRONGLY_TYPED_FROM, minor

    release = minor(torch_tensorrt_version)
    strongly_typed = release >= STRONGLY_TYPED_FROM
    kwargs: dict[str, Any] = {
        "workspace_size": config.workspace_size,
        "min_block_size": config.min_block_size,
        "truncate_double": config.truncate_double,
        "require_full_compilation": config.require_full_compilation,
        "torch_executed_ops": set(config.torch_executed_ops),
        "sparse_weights": config.sparse_weights,
        "hardware_compatible": config.hardware_compatible,
        "version_compatible": config.version_compatible,
        "disable_tf32": not config.tf32,
    }
    if config.optimization_level is not None:
        kwargs["optimization_level"] = config.optimization_level
    if config.use_fp32_acc:
        kwargs["use_fp32_acc"] = True
    if jit:
        kwargs["pass_through_build_failures"] = True
    lower = config.lowest_precision != torch.float32
    if not strongly_typed:
        kwargs["enabled_precisions"] = {PRECISIONS[p] for p in config.enabled_precisions}
        kwargs["use_python_runtime"] = config.use_python_runtime
        if config.use_explicit_typing:
            kwargs["use_explicit_typing"] = True
        elif lower and release >= EXPLICIT_TYPING_DEFAULT_FROM:
            kwargs["use_explicit_typing"] = False  # its default True would skip the FP16/BF16 flags
        return kwargs
    if jit and lower:
        raise ConfigError(
            f"torch-tensorrt {torch_tensorrt_version} applies {config.lowest_precision} (its autocast) only when "
            "compiling ahead of time, so torch.compile would build fp32 under an fp16 label: use "
            "TorchTensorRTAotBackend for lower precision, or enabled_precisions=('fp32',) here"
        )
    if config.use_python_runtime:
        raise ConfigError(
            f"TorchTensorRTConfig.use_python_runtime: torch-tensorrt {torch_tensorrt_version} removed the Python "
            "runtime option (engines always run in its C++ runtime); set use_python_runtime=False"
        )
    if config.lowest_precision != torch.float32:
        kwargs["enable_autocast"] = True
        kwargs["autocast_low_precision_type"] = config.lowest_precision
    return kwargs


def check_known_settings(kwargs: dict[str, Any], known: frozenset[str] | None, version: str) -> None:
    """Refuse settings the installed release does not know: ``dynamo.compile`` would swallow them in
    ``**kwargs`` and build something else than asked (an fp32 engine for an fp16 config)."""
    if known is None:
        return
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise BuildError(
            f"torch-tensorrt {version} does not know the compile settings {unknown}, so it would ignore them "
            "silently; leave them out of TorchTensorRTConfig or install a release that has them"
        )


@attrs.frozen(kw_only=True)
class TorchTensorRTJitBackendConfig(BackendConfig):
    """Settings of TorchTensorRTJitBackend: ``torch.compile(backend="torch_tensorrt")``."""

    compile_config: TorchTensorRTConfig = attrs.field(
        factory=TorchTensorRTConfig, validator=attrs.validators.instance_of(TorchTensorRTConfig)
    )


def _serializable_runtime(instance: Any, attribute: attrs.Attribute, value: TorchTensorRTConfig) -> None:
    if value.use_python_runtime:
        raise ValueError(
            "TorchTensorRTAotBackend saves engines in the exported-program form, which only "
            "Torch-TensorRT's C++ runtime can write: set use_python_runtime=False, or use "
            "TorchTensorRTJitBackend for the Python runtime"
        )


@attrs.frozen(kw_only=True)
class TorchTensorRTAotBackendConfig(BackendConfig):
    """Settings of TorchTensorRTAotBackend: torch.export, then ``torch_tensorrt.dynamo.compile``."""

    compile_config: TorchTensorRTConfig = attrs.field(
        factory=TorchTensorRTConfig,
        validator=[attrs.validators.instance_of(TorchTensorRTConfig), _serializable_runtime],
    )
