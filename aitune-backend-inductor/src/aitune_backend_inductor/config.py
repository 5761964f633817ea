"""Configurations of the inductor backends."""

from __future__ import annotations

import attrs
from aitune.backend import BackendConfig


@attrs.frozen(kw_only=True)
class TorchInductorJitBackendConfig(BackendConfig):
    """Settings of TorchInductorJitBackend."""


@attrs.frozen(kw_only=True)
class TorchInductorAotBackendConfig(BackendConfig):
    """Settings of TorchInductorAotBackend."""
