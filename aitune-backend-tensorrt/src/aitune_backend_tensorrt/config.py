"""Configurations of the tensorrt backends."""

from __future__ import annotations

import attrs
from aitune.backend import BackendConfig


@attrs.frozen(kw_only=True)
class TensorRTBackendConfig(BackendConfig):
    """Settings of TensorRTBackend."""
