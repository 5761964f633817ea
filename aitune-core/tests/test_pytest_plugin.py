"""aitune's pytest plugin changes a test suite only when the suite asks for it."""

from __future__ import annotations

import importlib.metadata
import os
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


def _pytest(folder: Path, *args: str, env: dict[str, str] | None = None) -> str:
    # a folder with its own pytest.ini, so this repository's addopts do not apply
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", *args, str(folder)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
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


SPINNERS = '''
import os
import time
from pathlib import Path


def spinners():
    """This process's children that are running or runnable, and the cores they may use."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid() and state == "R":
            found.append(os.sched_getaffinity(int(proc.name)))
    return found


def wait_for_spinner(core):
    """The spinners seen once one is pinned to ``core`` (it pins itself after starting), or at 10 s
    (``SPINNER_WAIT_S``: shorter where none is expected)."""
    for _ in range(int(float(os.environ.get("SPINNER_WAIT_S", "10")) / 0.05)):
        found = spinners()
        if {core} in found:
            return found
        time.sleep(0.05)
    return found
'''

BUSY_SUITE = (
    SPINNERS
    + """

def test_unmarked():
    core = min(os.sched_getaffinity(0))
    assert wait_for_spinner(core) == [{core}]
"""
)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc (Linux)")
@pytest.mark.busy
def test_a_busy_test_shares_one_of_its_cores_with_a_spinning_process(busy_core: int) -> None:
    namespace: dict[str, object] = {}
    exec(SPINNERS, namespace)
    assert namespace["wait_for_spinner"](busy_core) == [{busy_core}], (
        "one child spins, pinned to one of this test's cores"
    )
    assert busy_core in os.sched_getaffinity(0)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc (Linux)")
def test_busy_core_option_keeps_a_core_busy_for_every_test(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_theirs.py").write_text(BUSY_SUITE)
    assert "1 passed" in _pytest(tmp_path, "-p", "aitune.testing.fixtures", "--busy-core")
    with pytest.raises(AssertionError):  # without the option nothing spins (2 s is long enough to see none)
        _pytest(tmp_path, "-p", "aitune.testing.fixtures", env={**os.environ, "SPINNER_WAIT_S": "2"})
