"""Public test helpers for backend authors.

This package's :mod:`aitune.testing.fixtures` is an opt-in pytest plugin (``pytest -p
aitune.testing.fixtures``, or ``pytest_plugins = ["aitune.testing.fixtures"]`` in a top-level
conftest.py). It gives ``aitune_manager`` (a fresh plugin manager), ``register_plugin`` (inline
plugins), ``aitune_cache_dir`` (a temporary cache) and ``toy_backends``, and skips
``@pytest.mark.gpu`` tests visibly on machines without CUDA. Installing aitune-core loads none of
it into other projects' test runs. Subclass :class:`BackendConformance` in a backend's tests to
check the contract, and compare outputs with :func:`assert_matches_eager`, which holds on any CPU.
"""

from __future__ import annotations

from typing import Any

from .compare import assert_matches_eager
from .configs import config_from_json, config_to_json

__all__ = [
    "BackendConformance",
    "TinyMLP",
    "assert_matches_eager",
    "config_from_json",
    "config_to_json",
    "tiny_samples",
]


def __getattr__(name: str) -> Any:
    """The conformance suite imports pytest: only when asked for, so the stand-in backends
    run where pytest is not installed."""
    if name in ("BackendConformance", "TinyMLP", "tiny_samples"):
        from . import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
