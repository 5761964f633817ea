"""The torchao backends (not implemented yet: building raises a clear error)."""

from __future__ import annotations

from aitune.backend import PendingBackend

from .config import TorchAOBackendConfig


class TorchAOBackend(PendingBackend):
    """TorchAO quantization (int8 weight-only, int8 dynamic, int4, float8), optionally compiled."""

    name = "torchao"
    config_class = TorchAOBackendConfig
    planned = "issue 6"
