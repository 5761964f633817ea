"""Importing this module turns JIT tuning on: make ``import aitune.torch.jit.enable`` a script's first import."""

from __future__ import annotations

from ...engine.jit.hooks import enable

enable()
