"""pytest fixtures for aitune and its plugins: a pytest plugin that a test suite opts into.

Load it with ``pytest -p aitune.testing.fixtures``, with ``addopts = "-p
aitune.testing.fixtures"`` in the pytest config, or with ``pytest_plugins =
["aitune.testing.fixtures"]`` in the top-level conftest.py. Installing aitune-core does not load it: a
library must not change the test suites of the projects installed next to it. A suite that loads it
gets its own ``AITUNE_CONFIG_DIR`` for the session, so no test writes the user's signing key.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_SPIN = """
import os, sys
parent = os.getppid()
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {int(sys.argv[1])})
while os.getppid() == parent:  # ends by itself when the test process is gone
    for _ in range(1_000_000):
        pass
"""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--busy-core",
        action="store_true",
        help="run every test with one core kept busy by another process (as tests marked busy always run)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU with CUDA (skipped visibly without one)")
    config.addinivalue_line(
        "markers", "busy: runs with one core kept busy by another process, so a timing dependence fails at once"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to torch on this machine")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _aitune_private_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The test session's own ``AITUNE_CONFIG_DIR``: the signing key ``ait.save`` makes on first use
    (see :mod:`aitune.artifact.ownkey`) never lands in the user's real config folder."""
    path = tmp_path_factory.mktemp("aitune-config")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AITUNE_CONFIG_DIR", str(path))
        yield path


@pytest.fixture
def busy_core() -> Iterator[int]:
    """Another process spinning on one of this process's cores for the test's duration, as on a
    shared laptop or CI runner; yields the core's number. A test that needs a candidate to win a
    timing race fails under it, which is the point: decide with a scripted clock or the gate off."""
    core = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    spinner = subprocess.Popen([sys.executable, "-c", _SPIN, str(core)])
    try:
        yield core
    finally:
        spinner.kill()
        spinner.wait()


@pytest.fixture(autouse=True)
def _busy_when_asked(request: pytest.FixtureRequest) -> None:
    """Tests marked ``busy`` (every test under ``--busy-core``) get :func:`busy_core`."""
    if request.node.get_closest_marker("busy") or request.config.getoption("--busy-core"):
        request.getfixturevalue("busy_core")


@pytest.fixture
def aitune_manager() -> Iterator[object]:
    """A fresh plugin manager with every installed plugin loaded, used process-wide during the test
    (``set_manager``), as suites written against this fixture expect; a test may also pass it on
    explicitly (``ait.tune(..., manager=aitune_manager)``)."""
    from aitune.plugins import AituneManager, set_manager

    manager = AituneManager()
    manager.load_entry_points()
    previous = set_manager(manager)
    try:
        yield manager
    finally:
        set_manager(previous)


@pytest.fixture
def register_plugin(aitune_manager: object) -> Callable[..., object]:
    """Register an inline plugin (a module, class or object with hookimpls) for this test only."""

    def register(plugin: object, name: str | None = None, distribution: str = "test-plugin") -> object:
        aitune_manager.register(plugin, name=name, distribution=distribution)  # type: ignore[attr-defined]
        return plugin

    return register


@pytest.fixture
def aitune_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary ``AITUNE_CACHE_DIR`` for this test."""
    path = tmp_path / "aitune-cache"
    path.mkdir()
    monkeypatch.setenv("AITUNE_CACHE_DIR", str(path))
    return path


@pytest.fixture
def toy_backends(register_plugin: Callable[..., object]) -> object:
    """The toy backends of :mod:`aitune.testing.backends`, registered for this test."""
    from aitune.testing import backends

    return register_plugin(backends, name="aitune.testing.backends", distribution="aitune-core")
