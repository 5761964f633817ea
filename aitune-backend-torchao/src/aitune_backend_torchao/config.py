"""Configurations of the torchao backends."""

from __future__ import annotations

import attrs
from aitune.backend import BackendConfig


@attrs.frozen(kw_only=True)
class TorchAOBackendConfig(BackendConfig):
    """Settings of TorchAOBackend."""
