"""Configurations of the onnxruntime backends."""

from __future__ import annotations

import attrs
from aitune.backend import BackendConfig


@attrs.frozen(kw_only=True)
class ONNXRuntimeBackendConfig(BackendConfig):
    """Settings of ONNXRuntimeBackend."""
