"""The whole repository's test run: which tests share one pytest-xdist worker.

``nox -s tests`` runs the suite on two workers (``-n 2 --dist loadgroup``, as CI does). The serving and Ray
folders start servers and local Ray clusters of their own and stop them after their folder's last
test (``aitune-serve-ray/tests/conftest.py``), so each folder runs whole, in collection order, on one
worker: they form one group, and the rest is shared out test by test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).parent
ONE_WORKER = ("aitune-serve-kserve/tests", "aitune-serve-ray/tests", "aitune-executor-ray/tests")
"""Folders whose tests run on one worker, in order: the servers and the Ray clusters they share."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    folders = [ROOT / f for f in ONE_WORKER]
    for item in items:
        if any(folder in Path(item.path).parents for folder in folders):
            item.add_marker(pytest.mark.xdist_group("servers"))
