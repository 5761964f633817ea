"""What ``aitune serve --engine ray`` says when the cluster it joins does not take it as asked: a
cluster that wants Ray's auth token (one line naming the variables to set, at once, not Ray's 20 s
of retries and traceback), and a Ray Serve already running there with another HTTP port (the URL
printed is the one Serve listens on, with a warning that ``--port`` was not applied)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import ClassVar

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow
FACTORY = "aitune_testkit.serving:build_two_heads"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("auth", "advice"),
    [
        ({}, "set RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN"),
        ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 32}, "set the cluster's token in RAY_AUTH_TOKEN"),
    ],
    ids=["no-token-mode", "wrong-token"],
)
def test_a_cluster_that_wants_another_token_is_one_line_and_exit_1(ray_address, tmp_path, auth, advice):
    """The shared Ray runs with token auth (Ray's default for a local Ray): a command without
    ``RAY_AUTH_MODE=token``, or with a token that is not the cluster's, fails with one line that says
    what to set, without Ray's retry loop (one refusal logged, not twenty) or its traceback."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        pytest.skip("the shared Ray runs without token authentication here (RAY_AUTH_MODE set otherwise)")
    artifact = tmp_path / "model.ait"
    artifact.write_bytes(b"never read: the cluster refuses the command first")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")} | auth
    command = [sys.executable, "-m", "aitune", "serve", str(artifact), "--engine", "ray"]
    command += ["--address", ray_address, "--factory", FACTORY, "--port", str(_free_port())]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {artifact} could not be served: the Ray cluster at {ray_address}"), last
    assert advice in last and "RAY_AUTH_TOKEN_PATH" in last, last
    assert "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
    assert done.stderr.count("Failed to get cluster ID") <= 1, "Ray's connection retries ran:\n" + done.stderr[-3000:]


@pytest.mark.parametrize("mode", ["token", None])
@pytest.mark.parametrize("wrapped", [True, False], ids=["retries-exhausted", "no-token-found"])
def test_a_token_refusal_raised_by_ray_init_is_a_serve_start_error(monkeypatch, tmp_path, mode, wrapped):
    """Where the GCS cannot be asked first (a ``ray://`` address), ``ray.init``'s own refusal is
    translated: its ``ConnectionError`` caused by ``AuthenticationError`` after the retries, or the
    ``AuthenticationError`` it raises at once when token mode is on and no token is found (both as
    Ray 2.60 raises them)."""
    from ray.exceptions import AuthenticationError

    import aitune_serve_ray.launch as launch
    from aitune.torch.serving import ServeStartError

    def refused(*args, **kwargs):
        try:
            raise AuthenticationError("RPC error: InvalidAuthToken: Authentication token is missing or incorrect")
        except AuthenticationError as exc:
            if not wrapped:
                raise
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from exc

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refused)
    if mode:
        monkeypatch.setenv("RAY_AUTH_MODE", mode)
    else:
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    artifact = tmp_path / "model.ait"
    artifact.write_bytes(b"never read")
    with pytest.raises(ServeStartError) as raised:
        launch.start(FACTORY, artifact, address="ray://10.0.0.1:10001", threads=1)
    said = str(raised.value)
    assert "\n" not in said
    assert said.startswith(f"{artifact} could not be served: the Ray cluster at ray://10.0.0.1:10001"), said
    assert "Authentication token is missing or incorrect" in said, said
    assert ("set RAY_AUTH_MODE=token" in said) is (mode is None), said
    assert "RAY_AUTH_TOKEN (or a file named by RAY_AUTH_TOKEN_PATH" in said, said


def test_another_connection_error_of_ray_init_stays_as_it_is(monkeypatch, tmp_path):
    """Only a token refusal is translated: an unreachable cluster is ``ray.init``'s to report."""
    import aitune_serve_ray.launch as launch

    def unreachable(*args, **kwargs):
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", unreachable)
    artifact = tmp_path / "model.ait"
    artifact.write_bytes(b"never read")
    with pytest.raises(ConnectionError, match="Failed to connect to Ray cluster"):
        launch.start(FACTORY, artifact, address="ray://10.0.0.1:10001", threads=1)


def test_a_running_serve_keeps_its_port_and_the_url_says_which(artifact, attach):
    """Serve already runs on the cluster with HTTP port ``kept``; ``start(port=asked)`` cannot move it
    (Serve only logs that): the URL it returns is on ``kept`` and answers, and a RuntimeWarning names
    both ports."""
    from ray import serve

    import aitune_serve_ray.launch as launch

    kept, asked = _free_port(), _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": kept})
    try:
        with pytest.warns(RuntimeWarning) as warned:
            url = launch.start(FACTORY, artifact, port=asked, threads=1)
        assert url == f"http://127.0.0.1:{kept}/v2/models/twoheads"
        with urllib.request.urlopen(f"{url}/ready", timeout=60) as answer:
            assert answer.status == 200
        said = [str(w.message) for w in warned if "Ray Serve" in str(w.message)]
        assert len(said) == 1, said
        assert f"127.0.0.1:{kept}" in said[0] and f"port {asked} not applied" in said[0], said[0]
    finally:
        serve.delete(launch.APP)


def test_the_command_prints_the_port_serve_kept_and_warns_in_one_line(artifact, attach, tmp_path):
    """``aitune serve --address ... --port asked`` on a cluster whose Serve listens on ``kept``: a
    ``warning:`` line names both, and the ``serving ... at`` line gives ``kept``."""
    from ray import serve

    kept, asked = _free_port(), _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": kept})
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    command = [sys.executable, "-m", "aitune", "serve", str(artifact), "--engine", "ray", "--address", attach]
    command += ["--factory", FACTORY, "--port", str(asked), "--threads", "1"]
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True)
    try:
        deadline = time.monotonic() + 180
        while "serving " not in out.read_text():
            assert process.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, f"not serving within 180 s:\n{err.read_text()[-3000:]}"
            time.sleep(1)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=180)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    serving = next(line for line in out.read_text().splitlines() if line.startswith("serving "))
    assert f" at http://127.0.0.1:{kept}/v2/models/twoheads " in serving, serving
    warned = [line for line in err.read_text().splitlines() if line.startswith("warning: Ray Serve")]
    assert len(warned) == 1, err.read_text()[-3000:]
    assert f"127.0.0.1:{kept}" in warned[0] and f"port {asked} not applied" in warned[0], warned[0]


@pytest.mark.parametrize("client", [AttributeError("no http_config"), RuntimeError("no Serve client")])
def test_a_ray_without_the_serve_client_gives_the_asked_port_with_a_warning(monkeypatch, client):
    """The HTTP options in effect are read from Serve's client (no public getter in Ray): a Ray where
    that read fails still gets a URL, the asked port, and a warning that it could not be checked."""
    import ray.serve.context

    from aitune_serve_ray.launch import _serve_http

    def missing(*args, **kwargs):
        raise client

    monkeypatch.setattr(ray.serve.context, "_get_global_client", missing)
    said: list[str] = []
    assert _serve_http("127.0.0.1", 8123, said.append) == ("127.0.0.1", 8123)
    assert len(said) == 1 and said[0].startswith("could not check which HTTP port Ray Serve listens on"), said
    assert "port 8123" in said[0], said


@pytest.mark.parametrize(
    ("replicas", "threads", "cpus", "said"),
    [
        (2, 2, 2, "2 replicas of 2 CPUs each (its torch threads) need 4 CPUs and this Ray has 2: pass --threads 1"),
        (3, 2, 4, "need 6 CPUs and this Ray has 4: pass --threads 1 or --replicas 2"),
        (3, 1, 2, "3 replicas of 1 CPUs each (its torch threads) need 3 CPUs and this Ray has 2: pass --replicas 2"),
        (1, 4, 2, "1 replica of 4 CPUs (its torch threads) needs 4 CPUs and this Ray has 2: pass --threads 2"),
        (2, 1, 2, None),
    ],
)
def test_replicas_asking_more_cpus_than_ray_has_are_named_with_the_options_that_fit(
    artifact, replicas, threads, cpus, said
):
    """Each replica asks Ray for its threads in CPUs; replicas that cannot all be placed would leave
    Ray Serve waiting forever without a word (``--replicas 2`` of an artifact tuned on 2 cores did)."""
    from aitune_serve_ray import deployment
    from aitune_serve_ray.launch import _cpus_short

    app = deployment(FACTORY, artifact, replicas=replicas, threads=threads)
    short = _cpus_short(app, cpus)
    assert short == said if said is None else said in (short or ""), short
    # autoscaled: the replicas it starts with must fit, the rest are the autoscaler's to place
    autoscaled = {"autoscaling_config": {"min_replicas": replicas, "max_replicas": replicas + 4}}
    assert _cpus_short(deployment(FACTORY, artifact, threads=threads, deployment_options=autoscaled), cpus) == short


@pytest.mark.parametrize("here", [True, False], ids=["ray-started-here", "cluster"])
def test_replicas_a_ray_cannot_place_fail_at_once_on_its_own_ray_and_warn_on_a_cluster(monkeypatch, artifact, here):
    """On the Ray ``aitune serve`` starts itself nothing will add CPUs: it stops before deploying, with
    the reason; a cluster's autoscaler may add nodes, so there it warns and deploys."""
    from ray import serve

    from aitune.torch.serving import ServeStartError
    from aitune_serve_ray import launch

    class Context:
        address_info: ClassVar[dict[str, str]] = {}

    deployed: list[str] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: Context())
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(launch, "_ask_gcs_once", lambda address: None)
    monkeypatch.setattr(serve, "start", lambda **kwargs: deployed.append("serve.start"))
    monkeypatch.setattr(launch, "_serve_http", lambda host, port, warn: (host, port))
    monkeypatch.setattr(serve, "run", lambda *args, **kwargs: deployed.append("serve.run"))
    warned: list[str] = []
    start = lambda: launch.start(  # noqa: E731
        FACTORY, artifact, replicas=3, threads=1, address=None if here else "10.0.0.1:6379", on_warning=warned.append
    )
    if here:
        with pytest.raises(ServeStartError, match="3 replicas of 1 CPUs each .* pass --replicas 2"):
            start()
        assert deployed == []
    else:
        start()
        assert deployed == ["serve.start", "serve.run"]
        assert len(warned) == 1 and "wait until the cluster has the CPUs" in warned[0], warned
