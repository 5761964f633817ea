"""Registers the torchao backends with aitune; imports no runtime."""

from __future__ import annotations

from aitune.plugin import BackendRegistrar, BackendSpec, hookimpl

from . import quiet

quiet.install()  # before anything imports torchao through aitune, or transformers does later


def _probe(device: str) -> str | None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    return None


@hookimpl
def aitune_register_backends(registry: BackendRegistrar) -> None:
    registry.add(
        BackendSpec(
            name="torchao",
            backend_class="aitune_backend_torchao.backend:TorchAOBackend",
            config_class="aitune_backend_torchao.config:TorchAOBackendConfig",
            default_candidate=False,  # quantization changes numbers: only tried when the user names it
            requirements=("torchao>=0.18,<0.19", "safetensors>=0.4"),
            devices=("cpu", "cuda"),
            probe=_probe,
            description="TorchAO quantization (int8 weight-only, int8 dynamic, int4, float8), optionally compiled",
            exports={"ModuleFilter": "aitune_backend_torchao.config:ModuleFilter"},
        )
    )
