"""Public test helpers for backend authors.

Installing aitune-core registers :mod:`aitune.testing.fixtures` as a pytest plugin, which gives
``aitune_manager`` (a fresh plugin manager), ``register_plugin`` (inline plugins),
``aitune_cache_dir`` (a temporary cache) and skips ``@pytest.mark.gpu`` tests visibly on machines
without CUDA. Subclass :class:`BackendConformance` in a backend's tests to check the contract, and compare
outputs with :func:`assert_matches_eager`, which holds on any CPU.
"""

from __future__ import annotations

from .compare import assert_matches_eager
from .conformance import BackendConformance, TinyMLP, tiny_samples

__all__ = ["BackendConformance", "TinyMLP", "assert_matches_eager", "tiny_samples"]
