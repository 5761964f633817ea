"""aitune's pytest plugin changes a test suite only when the suite asks for it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SUITE = """
import pytest


@pytest.mark.gpu
def test_on_a_gpu():
    pass
"""


def _pytest(folder: Path, *args: str) -> str:
    # a folder with its own pytest.ini, so this repository's addopts do not apply
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", *args, str(folder)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine no test is skipped either way")
def test_gpu_tests_of_another_project_are_skipped_only_when_it_opts_in(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: their own meaning\n")
    (tmp_path / "test_theirs.py").write_text(SUITE)
    assert "1 passed" in _pytest(tmp_path)  # installed, not asked for: their gpu marker is theirs
    assert "1 skipped" in _pytest(tmp_path, "-p", "aitune.testing.fixtures")
    assert not [ep for ep in importlib.metadata.entry_points(group="pytest11") if ep.value.startswith("aitune")]
