"""``aitune serve`` as a user runs it: a process that starts a local Ray, serves, and stops on Ctrl-C."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from aitune_testkit import serving

requests = pytest.importorskip("requests")
pytestmark = pytest.mark.slow


def test_aitune_serve_answers_on_localhost_and_stops_on_ctrl_c(artifact, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "aitune", "serve", str(artifact), "--engine", "ray"]
    command += ["--factory", "aitune_testkit.serving:build"]
    log = (tmp_path / "serve.log").open("w")
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's sockets need a short path; nox's TMPDIR is long
    process = subprocess.Popen(
        [*command, "--port", str(port), "--threads", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "RAY_TMPDIR": temp},
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if requests.get(url, timeout=10).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "aitune serve did not answer within 180 s"
            time.sleep(1)
        x = torch.randn(3, 8, 16)
        answer = requests.post(url, json={"x": x.tolist()}, timeout=60)
        assert answer.status_code == 200, answer.text
        with torch.no_grad():
            assert torch.allclose(torch.tensor(answer.json()["output"]), serving.build()(x), atol=1e-4)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=180)  # Serve takes its replicas down gracefully: slow on a busy machine
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    shutil.rmtree(temp, ignore_errors=True)
    output = (tmp_path / "serve.log").read_text()
    assert process.returncode == 0, output[-3000:]
    # Ctrl-C may land while serve.run is still returning (the first requests are answered before it
    # does): it is noted there and acted on, never lost
    assert "stopping: taking the application down" in output, output[-3000:]


def test_a_factory_that_does_not_import_is_a_usage_error(artifact):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "aitune",
            "serve",
            str(artifact),
            "--engine",
            "ray",
            "--factory",
            "no_such_package:build",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    said = " ".join(done.stderr.replace("│", " ").split())  # the message, out of typer's box
    assert "cannot import the model factory 'no_such_package:build'" in said, said
