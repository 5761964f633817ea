"""``--eager`` on the same engine and batching, ``--name``, and SIGTERM (what ``docker stop`` sends)
draining a request in flight and exiting 0."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from kserve_harness import running

from aitune.testing import assert_matches_eager

httpclient = pytest.importorskip("tritonclient.http")

import kserve_testmodel  # noqa: E402

pytestmark = pytest.mark.slow


def _request(url: str, model: str, x: np.ndarray):
    client = httpclient.InferenceServerClient(url, network_timeout=60)
    try:
        tensor = httpclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return client.infer(model, [tensor])
    finally:
        client.close()


def test_eager_serves_the_same_answers_without_tuned_backends_and_sigterm_drains(artifact, tmp_path):
    """One eager server whose every call takes a second: its answer is eager's, and SIGTERM sent while
    a request runs lets that request finish, then the process exits 0."""
    with running(
        artifact, tmp_path / "serve.log", "--eager", "--name", "ab", factory="kserve_testmodel:build_slow"
    ) as server:
        server.wait_ready("ab")
        x = np.random.default_rng(3).standard_normal((2, 8, 16)).astype(np.float32)
        answered = {}

        def call() -> None:
            try:
                answered["result"] = _request(server.url, "ab", x)
                answered["at"] = time.monotonic()
            except Exception as exc:  # reported by the assertion below
                answered["error"] = exc

        sender = threading.Thread(target=call)
        sender.start()
        time.sleep(0.4 * kserve_testmodel.SLOW_S)  # the request is in the model's (slow) call now
        started = time.monotonic()
        code = server.stop()
        sender.join(timeout=30)
        assert code == 0, server.output()
        assert time.monotonic() - started < 30
        assert "error" not in answered, answered.get("error")
        assert answered["at"] > started, "the request was answered before SIGTERM: nothing was in flight"
        result = answered["result"]
        with torch.no_grad():
            want = kserve_testmodel.build()(torch.from_numpy(x))
        assert_matches_eager(torch.tensor(result.as_numpy("logits")), want["logits"])
        assert result.get_response()["parameters"]["aitune_backend"] == "eager (no tuned module ran)"


def test_a_second_signal_during_the_drain_exits_at_once(artifact, tmp_path, monkeypatch):
    """SIGTERM drains; a second SIGTERM while a request is still in flight (its call takes a minute)
    exits at once with 128 + 15, as ``docker stop`` users and a second Ctrl-C expect."""
    mark = tmp_path / "stuck"
    monkeypatch.setenv("STUCK_MARK", str(mark))
    with running(
        artifact, tmp_path / "serve.log", "--eager", "--name", "stuck", factory="kserve_testmodel:build_stuck"
    ) as server:
        server.wait_ready("stuck")
        x = np.zeros((2, 8, 16), dtype=np.float32)
        x.flat[0] = kserve_testmodel.STUCK_VALUE
        sender = threading.Thread(target=lambda: _request_quietly(server.url, "stuck", x), daemon=True)
        sender.start()
        deadline = time.monotonic() + 30
        while not mark.exists():  # the model's call has started: it holds the request
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.05)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        while "stopping: answering the requests in flight" not in server.log.read_text():  # the drain began
            assert server.process.poll() is None and time.monotonic() < deadline + 30, server.output()
            time.sleep(0.05)
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=30)
        assert code == 128 + signal.SIGTERM, server.output()
        assert time.monotonic() - started < kserve_testmodel.STUCK_S, "it waited for the request in flight"


def _request_quietly(url: str, model: str, x: np.ndarray) -> None:
    with contextlib.suppress(Exception):  # the server exits under it: no answer is expected
        _request(url, model, x)


def test_sigterm_while_the_model_loads_exits_0_without_serving(artifact, tmp_path):
    """Its warm-up call takes a second (the slow eager model), so the signal lands in the load."""
    with running(artifact, tmp_path / "serve.log", "--eager", factory="kserve_testmodel:build_slow") as server:
        deadline = time.monotonic() + 120
        while "loading" not in server.log.read_text():
            assert server.process.poll() is None and time.monotonic() < deadline, server.output()
            time.sleep(0.1)
        code = server.stop()
        assert code == 0, server.output()
        said = server.output()
        assert "stopped before serving" in said, said


def test_a_ray_option_without_engine_ray_is_a_usage_error(artifact):
    done = subprocess.run(
        [sys.executable, "-m", "aitune", "serve", str(artifact), "--factory", "x:y", "--replicas", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    said = " ".join(done.stderr.replace("│", " ").split())
    assert "--replicas" in said and "--engine ray" in said, said


def test_a_factory_that_does_not_import_is_a_usage_error(artifact):
    done = subprocess.run(
        [sys.executable, "-m", "aitune", "serve", str(artifact), "--factory", "no_such_package:build"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    said = " ".join(done.stderr.replace("│", " ").split())
    assert "cannot import the model factory 'no_such_package:build'" in said, said


def test_an_artifact_that_does_not_load_is_one_error_line_and_exit_1(tmp_path):
    broken = tmp_path / "broken.ait"
    broken.write_bytes(b"not a zip")
    done = subprocess.run(
        [sys.executable, "-m", "aitune", "serve", str(broken), "--factory", "kserve_testmodel:build"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(kserve_testmodel.__file__).parent,
    )
    assert done.returncode == 1, done.stderr
    said = " ".join(done.stderr.split())
    assert said.startswith("error:") and "not a readable .ait artifact" in said, said
    assert "Traceback" not in done.stderr


def test_a_second_load_changes_nothing(artifact):
    """kserve calls ``load()`` inside a request whenever the model reads not ready: a loaded model
    is not built again (in a process of its own: kserve and tritonclient.grpc cannot share one)."""
    script = f"""
import kserve_testmodel
from aitune_serve_kserve.model import TunedModel
built = []
def factory():
    built.append(1)
    return kserve_testmodel.build()
model = TunedModel("m", factory, {str(artifact)!r}, threads=1)
assert model.load() and len(built) == 1
batcher = model.batcher
model.ready = False  # as after a failed health call
assert not model.load() and len(built) == 1 and model.batcher is batcher
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(kserve_testmodel.__file__).parent,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
