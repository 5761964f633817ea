"""Registers the Torch-TensorRT backends with aitune; imports no runtime.

The availability probe reads package metadata only (torch_tensorrt is never imported here: it
loads TensorRT's native libraries), so ``aitune backends`` can report a missing runtime or a
torch-tensorrt built for another torch without loading either.
"""

from __future__ import annotations

from aitune.plugin import BackendRegistrar, BackendSpec, hookimpl

from .versions import install_hint, runtime_problem

_EXPORTS = {"TorchTensorRTConfig": "aitune_backend_torchtrt.config:TorchTensorRTConfig"}


def _probe(device: str) -> str | None:
    problem = runtime_problem()
    if problem:
        return problem
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    return None


@hookimpl
def aitune_register_backends(registry: BackendRegistrar) -> None:
    registry.add(
        BackendSpec(
            name="torch_tensorrt_jit",
            backend_class="aitune_backend_torchtrt.backend:TorchTensorRTJitBackend",
            config_class="aitune_backend_torchtrt.config:TorchTensorRTJitBackendConfig",
            exports=_EXPORTS,
            devices=("cuda",),
            probe=_probe,
            install_hint=install_hint(),
            description="torch.compile(backend='torch_tensorrt'); compiles again on load",
        )
    )
    registry.add(
        BackendSpec(
            name="torch_tensorrt_aot",
            backend_class="aitune_backend_torchtrt.backend:TorchTensorRTAotBackend",
            config_class="aitune_backend_torchtrt.config:TorchTensorRTAotBackendConfig",
            exports=_EXPORTS,
            devices=("cuda",),
            probe=_probe,
            install_hint=install_hint(),
            description="torch.export compiled by Torch-TensorRT, saved as a .pt2 archive",
        )
    )
