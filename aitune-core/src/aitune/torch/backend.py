"""Backends by class name: core's own, and every installed plugin's, resolved lazily.

``from aitune.torch.backend import ONNXRuntimeBackend`` asks the plugin registry which
distribution exports that name and imports it only then. A first-party name whose distribution
is not installed raises :class:`ModuleNotFoundError` that says what to ``pip install``.

An entry point: an import statement names no manager, so these names are the process's plugins'
(:func:`aitune.plugins.get_manager`); with a manager of your own, ask its ``registry.resolve``.
"""

from __future__ import annotations

from typing import Any

from ..backend import Backend, BackendConfig, BuildContext, LoadContext, Tolerance
from ..builtin.eager import TorchEagerBackend, TorchEagerBackendConfig

FIRST_PARTY: dict[str, str] = {
    **dict.fromkeys(
        [
            "TorchInductorJitBackend",
            "TorchInductorJitBackendConfig",
            "TorchInductorAotBackend",
            "TorchInductorAotBackendConfig",
        ],
        "aitune-backend-inductor",
    ),
    **dict.fromkeys(
        ["ONNXRuntimeBackend", "ONNXRuntimeBackendConfig", "ONNXExecutionProvider"], "aitune-backend-onnxruntime"
    ),
    **dict.fromkeys(["TorchAOBackend", "TorchAOBackendConfig"], "aitune-backend-torchao"),
    **dict.fromkeys(
        [
            "TensorRTBackend",
            "TensorRTBackendConfig",
            "TensorRTProfile",
            "ONNXAutoCastConfig",
            "ModelOptQuantizationConfig",
        ],
        "aitune-backend-tensorrt",
    ),
    **dict.fromkeys(
        [
            "TorchTensorRTJitBackend",
            "TorchTensorRTJitBackendConfig",
            "TorchTensorRTAotBackend",
            "TorchTensorRTAotBackendConfig",
            "TorchTensorRTConfig",
        ],
        "aitune-backend-torchtrt",
    ),
}
"""Public names of the first-party plugins and the distribution that provides each."""

INSTALL: dict[str, str] = {"aitune-backend-onnxruntime": "'aitune-backend-onnxruntime[cpu]' (or [gpu])"}
"""What to pip install for a distribution, where a plain install is not enough."""

__all__ = [
    "Backend",
    "BackendConfig",
    "BuildContext",
    "LoadContext",
    "Tolerance",
    "TorchEagerBackend",
    "TorchEagerBackendConfig",
]


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    from ..plugins import get_manager

    registry = get_manager().registry
    exported = registry.public_names()
    if name in exported:
        value = registry.resolve(name)
        globals()[name] = value
        return value
    if name in FIRST_PARTY:
        dist = FIRST_PARTY[name]
        raise ModuleNotFoundError(
            f"{name} is provided by the {dist} distribution, which is not installed (or its plugin is "
            f"disabled): pip install {INSTALL.get(dist, dist)}",
            name=dist.replace("-", "_"),
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}; installed backends: {registry.names()}")


def __dir__() -> list[str]:
    from ..plugins import get_manager

    return sorted(set(__all__) | set(get_manager().registry.public_names()))
