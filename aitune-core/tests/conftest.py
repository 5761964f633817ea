"""Helpers for core's tests: fake installed distributions with entry points, and the testkit's doubles."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def fake_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Install a throwaway distribution (dist-info + module) on sys.path for one test."""

    def make(dist: str, module: str, source: str, version: str = "9.9.9", ep_name: str | None = None) -> None:
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[aitune]\n{ep_name or module} = {module}\n")
        monkeypatch.syspath_prepend(str(site))

    return make


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test gets its own aitune cache, so build-cache hits never leak between tests."""
    path = tmp_path_factory.mktemp("aitune-cache")
    monkeypatch.setenv("AITUNE_CACHE_DIR", str(path))
    return path


@pytest.fixture
def toy_backends(toy_backends: object, register_plugin: Any) -> object:
    """:mod:`aitune.testing.fixtures`' toy backend, and beside it the testkit's doubles
    (:mod:`aitune_testkit.doubles`: wrong, NaN, mutating, flat, not applicable) for core's own tests."""
    from aitune_testkit import doubles

    register_plugin(doubles, name="aitune_testkit.doubles", distribution="aitune-testkit")
    return toy_backends
