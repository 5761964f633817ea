"""Configurations of the torchtrt backends."""

from __future__ import annotations

import attrs
from aitune.backend import BackendConfig


@attrs.frozen(kw_only=True)
class TorchTensorRTJitBackendConfig(BackendConfig):
    """Settings of TorchTensorRTJitBackend."""


@attrs.frozen(kw_only=True)
class TorchTensorRTAotBackendConfig(BackendConfig):
    """Settings of TorchTensorRTAotBackend."""
