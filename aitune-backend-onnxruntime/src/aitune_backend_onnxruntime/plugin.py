"""Registers the onnxruntime backend with aitune; imports no runtime."""

from __future__ import annotations

import importlib.metadata

from aitune import hookimpl
from aitune.registry import BackendRegistry, BackendSpec

CPU_DISTRIBUTIONS = ("onnxruntime",)
GPU_DISTRIBUTIONS = ("onnxruntime-gpu", "ort-nightly-gpu", "onnxruntime-training")
"""Distributions of ONNX Runtime built with the CUDA and TensorRT execution providers."""
MIN_VERSION = (1, 17)


def installed_runtime() -> tuple[str, str] | None:
    """The installed ONNX Runtime distribution and its version, found by metadata alone."""
    for dist in GPU_DISTRIBUTIONS + CPU_DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def runtime_unavailable() -> str | None:
    """Why ONNX Runtime cannot be used at all, or None."""
    found = installed_runtime()
    if found is None:
        return (
            "ONNX Runtime is not installed: pip install 'aitune-backend-onnxruntime[cpu]' "
            "(or '[gpu]' for the CUDA and TensorRT execution providers)"
        )
    dist, version = found
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < MIN_VERSION:
        return (
            f"{dist} {version} is installed but >= {'.'.join(map(str, MIN_VERSION))} is required: pip install -U {dist}"
        )
    return None


def provider_unavailable(provider: str) -> str | None:
    """Why the execution provider ``"cpu"``, ``"cuda"`` or ``"tensorrt"`` cannot run here, or None."""
    reason = runtime_unavailable()
    if reason or provider == "cpu":
        return reason
    import torch

    reasons = []
    if not torch.cuda.is_available():
        reasons.append("no CUDA device is visible to torch")
    dist, version = installed_runtime()  # type: ignore[misc]
    if dist not in GPU_DISTRIBUTIONS:
        reasons.append(
            f"the installed {dist} {version} is the CPU-only build (replace it: pip uninstall onnxruntime && "
            "pip install onnxruntime-gpu)"
        )
    return "; ".join(reasons) or None


def _probe(device: str) -> str | None:
    if device == "cpu":
        return provider_unavailable("cpu")
    reason = provider_unavailable("cuda")
    return f"CUDA and TensorRT execution providers unavailable: {reason}" if reason else None


@hookimpl
def aitune_register_backends(registry: BackendRegistry) -> None:
    registry.add(
        BackendSpec(
            name="onnxruntime",
            backend_class="aitune_backend_onnxruntime.backend:ONNXRuntimeBackend",
            config_class="aitune_backend_onnxruntime.config:ONNXRuntimeBackendConfig",
            exports={"ONNXExecutionProvider": "aitune_backend_onnxruntime.config:ONNXExecutionProvider"},
            requirements=("onnx>=1.16", "onnxscript>=0.1"),
            devices=("cpu", "cuda"),
            probe=_probe,
            description="ONNX export run by ONNX Runtime (CPU, CUDA or TensorRT execution provider)",
        )
    )
