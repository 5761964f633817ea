"""Public test helpers for backend authors.

This package is also an opt-in pytest plugin (``pytest -p aitune.testing``, or ``pytest_plugins =
["aitune.testing"]`` in a top-level conftest.py). It gives ``aitune_manager`` (a fresh plugin
manager), ``register_plugin`` (inline plugins), ``aitune_cache_dir`` (a temporary cache) and
``toy_backends``, and skips ``@pytest.mark.gpu`` tests visibly on machines without CUDA.
Installing aitune-core loads none of it into other projects' test runs. Subclass
:class:`BackendConformance` in a backend's tests to check the contract.
"""

from __future__ import annotations

from .conformance import BackendConformance, TinyMLP, tiny_samples
from .fixtures import (
    aitune_cache_dir,
    aitune_manager,
    pytest_collection_modifyitems,
    pytest_configure,
    register_plugin,
    toy_backends,
)

__all__ = [
    "BackendConformance",
    "TinyMLP",
    "aitune_cache_dir",
    "aitune_manager",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "register_plugin",
    "tiny_samples",
    "toy_backends",
]
