"""The torchtrt backends (not implemented yet: building raises a clear error)."""

from __future__ import annotations

from aitune.backend import PendingBackend

from .config import TorchTensorRTJitBackendConfig, TorchTensorRTAotBackendConfig


class TorchTensorRTJitBackend(PendingBackend):
    """torch.compile(backend='torch_tensorrt')."""

    name = "torch_tensorrt_jit"
    config_class = TorchTensorRTJitBackendConfig
    planned = "issue 12"


class TorchTensorRTAotBackend(PendingBackend):
    """torch.export compiled by Torch-TensorRT, saved in its deployable form."""

    name = "torch_tensorrt_aot"
    config_class = TorchTensorRTAotBackendConfig
    planned = "issue 12"
