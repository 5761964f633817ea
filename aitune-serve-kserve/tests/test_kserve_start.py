"""A model that cannot be served stops ``aitune serve`` before it listens: one line saying why, exit
status 1, no traceback, well within a minute."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kserve_harness import HERE, free_port

pytestmark = pytest.mark.slow


def _serve(artifact: Path, factory: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "aitune", "serve", str(artifact), "--factory", factory]
    return subprocess.run(
        [*command, "--port", str(free_port()), "--threads", "1"],
        capture_output=True,
        text=True,
        cwd=HERE,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))},
    )


def _error_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    return [line for line in done.stderr.splitlines() if line.strip()]


def test_a_corrupt_artifact_fails_with_one_line(artifact, tmp_path):
    broken = tmp_path / "broken.ait"
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of a payload changed: its digest no longer matches
    broken.write_bytes(bytes(data))
    [line] = _error_lines(_serve(broken, "kserve_testmodel:build"))
    assert line.startswith("error: ") and "broken.ait" in line


def test_a_factory_that_raises_fails_with_one_line(artifact):
    [line] = _error_lines(_serve(artifact, "kserve_testmodel:build_failing"))
    assert line == (f"error: {artifact} could not be served: RuntimeError: the checkpoint weights.bin is missing")
