"""``aitune serve --engine ray`` as a user runs it: a process that starts a local Ray, serves the Open
Inference Protocol, and stops on Ctrl-C or SIGTERM, or that joins a running Ray (``--address``);
``serve build`` and the application builder's arguments. (A Serve config file of two artifacts
under Ray's own ``serve run`` is test_ray_docs.py's, run as the docs write it.)

The tests of the local Ray's own start and stop start one each; the others attach to the one Ray
this folder's tests share (conftest.py's ``ray_address``)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from aitune_testkit import docs, serving

from aitune.testing import assert_matches_eager

httpclient = pytest.importorskip("tritonclient.http")
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(process: subprocess.Popen, log, url: str, models: list[str], within_s: float = 180) -> None:
    docs.wait_ready(process, url, models, within_s, lambda: log.read_text()[-3000:])


def _logits(url: str, model: str, x: np.ndarray) -> torch.Tensor:
    client = httpclient.InferenceServerClient(url, network_timeout=60)
    try:
        tensor = httpclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(model, [tensor], outputs=[httpclient.InferRequestedOutput("logits")])
        return torch.tensor(result.as_numpy("logits"))
    finally:
        client.close()


def _serve_status(dashboard: str) -> dict:
    """What Ray's own ``serve status --address DASHBOARD`` prints, read as the YAML it is. A local
    Ray 2.60 requires its token (``~/.ray/auth_token``), which Ray's CLI sends in token mode."""
    import yaml

    done = subprocess.run(
        [str(Path(sys.executable).parent / "serve"), "status", "--address", dashboard],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_AUTH_MODE": "token"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return yaml.safe_load(done.stdout)


def _stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=180)  # Serve takes its replicas down gracefully: slow on a busy machine
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_aitune_serve_answers_on_localhost_and_stops_on_ctrl_c(artifact, tmp_path):
    port, metrics_port, dashboard_port = _free_port(), _free_port(), _free_port()
    command = [sys.executable, "-m", "aitune", "serve", str(artifact), "--engine", "ray"]
    command += ["--factory", "aitune_testkit.serving:build_two_heads", "--port", str(port), "--threads", "1"]
    command += ["--name", "tiny", "--max-rows", "8", "--no-check"]  # the kserve engine's options hold here too
    command += ["--metrics-port", str(metrics_port), "--dashboard-port", str(dashboard_port)]
    log = tmp_path / "serve.log"
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's sockets need a short path; nox's TMPDIR is long
    process = subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "RAY_TMPDIR": temp}
    )
    url = f"127.0.0.1:{port}"
    try:
        _wait_ready(process, log, url, ["tiny"])
        deadline = time.monotonic() + 60
        while f"at http://{url}/v2/models/tiny" not in log.read_text():  # printed once serve.run returned
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        x = np.random.default_rng(0).standard_normal((3, 8, 16)).astype(np.float32)
        with torch.no_grad():
            assert_matches_eager(_logits(url, "tiny", x), serving.build_two_heads()(torch.from_numpy(x))["logits"])
        with pytest.raises(Exception, match="9 rows in one request; this server takes at most 8"):
            _logits(url, "tiny", np.zeros((9, 8, 16), np.float32))
        # Ray's own tools: serve status through the dashboard, Prometheus on the metrics port
        status = _serve_status(f"http://127.0.0.1:{dashboard_port}")
        assert status["applications"]["aitune"]["status"] == "RUNNING", status
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as answer:
            assert b"ray_" in answer.read()
    finally:
        _stop(process)
    shutil.rmtree(temp, ignore_errors=True)
    output = log.read_text()
    assert process.returncode == 0, output[-3000:]
    # Ctrl-C may land while serve.run is still returning (the first requests are answered before it
    # does): it is noted there and acted on, never lost
    assert "stopping: taking the application down" in output, output[-3000:]


def test_sigterm_answers_the_request_in_flight_and_exits_0(artifact, tmp_path):
    """What ``docker stop`` sends, while a request runs (each call of the eager model takes seconds):
    the request is answered, the application taken down, the process exits 0."""
    port = _free_port()
    command = [sys.executable, "-m", "aitune", "serve", str(artifact), "--engine", "ray", "--eager"]
    command += ["--factory", "aitune_testkit.serving:build_slow_two_heads", "--port", str(port), "--threads", "1"]
    command += ["--name", "slow", "--no-check"]
    log = tmp_path / "serve.log"
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    process = subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "RAY_TMPDIR": temp}
    )
    url = f"127.0.0.1:{port}"
    answered: dict = {}
    try:
        _wait_ready(process, log, url, ["slow"])
        x = np.random.default_rng(1).standard_normal((2, 8, 16)).astype(np.float32)

        def call() -> None:
            try:
                answered["logits"] = _logits(url, "slow", x)
                answered["at"] = time.monotonic()
            except Exception as exc:  # reported by the assertion below
                answered["error"] = exc

        sender = threading.Thread(target=call)
        sender.start()
        time.sleep(0.5 * serving.SLOW_S)  # the request is in the model's (slow) call now
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        sender.join(timeout=120)
        process.wait(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        shutil.rmtree(temp, ignore_errors=True)
    assert process.returncode == 0, log.read_text()[-3000:]
    assert "error" not in answered, answered.get("error")
    assert answered["at"] > sent, "answered before SIGTERM: nothing was in flight"
    with torch.no_grad():
        assert_matches_eager(answered["logits"], serving.build_two_heads()(torch.from_numpy(x))["logits"])


def test_serve_build_writes_the_config_of_a_deployment(artifact, tmp_path):
    """``serve build`` takes a built application (a module of the user's own holding
    ``deployment(...)``'s result; a builder with ``args:`` is for config files) and writes its config."""
    import yaml

    (tmp_path / "mydeploy.py").write_text(
        "import aitune_serve_ray\n"
        f"app = aitune_serve_ray.deployment('aitune_testkit.serving:build_two_heads', {str(artifact)!r}, replicas=2)\n"
    )
    serve_cli = Path(sys.executable).parent / "serve"
    out = tmp_path / "built.yaml"
    done = subprocess.run(
        [str(serve_cli), "build", "mydeploy:app", "-d", str(tmp_path), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [application] = yaml.safe_load(out.read_text())["applications"]
    assert application["import_path"] == "mydeploy:app"
    [deployment] = application["deployments"]
    assert deployment["name"] == "TunedModel" and deployment["num_replicas"] == 2


def test_the_application_builder_refuses_what_it_does_not_take(artifact):
    import aitune_serve_ray

    with pytest.raises(ValueError, match="unknown argument 'batch_size'"):
        aitune_serve_ray.app({"artifact": str(artifact), "factory": "m:b", "batch_size": 4})
    with pytest.raises(ValueError, match="needs factory"):
        aitune_serve_ray.app({"artifact": str(artifact)})
    app = aitune_serve_ray.app(
        {
            "artifact": str(artifact),
            "factory": "m:b",
            "name": "other",
            "load_options": {"check": False},
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 2},
        }
    )
    bound = app._bound_deployment  # Ray Serve has no public accessor for a bound application's arguments
    assert bound._deployment_config.autoscaling_config.max_replicas == 2
    assert bound.init_kwargs["name"] == "other" and bound.init_kwargs["load_options"].check is False


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


def test_an_artifact_the_replicas_cannot_load_is_one_error_line_and_exit_1(attach, tmp_path):
    """Ray Serve gives up on the replicas; the command, joined to a running Ray with ``--address``,
    says why in one line (the replicas' own error), with none of Ray's tracebacks on the terminal,
    exits 1, and leaves no application behind on the cluster."""
    from ray import serve

    broken = tmp_path / "broken.ait"
    broken.write_bytes(b"not a zip")
    command = [sys.executable, "-m", "aitune", "serve", str(broken), "--engine", "ray", "--address", attach]
    command += ["--factory", "aitune_testkit.serving:build_two_heads", "--port", str(_free_port())]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {broken} could not be served: ArtifactError:"), last
    assert "not a readable .ait artifact" in last, last
    assert "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
    assert "aitune" not in serve.status().applications, "the failed application is still on the cluster"
