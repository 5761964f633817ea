"""The deployment on a real local Ray Serve, driven by Triton's own client (nobody here wrote it): one
replica, loopback only, a bounded number of requests.

Serve starts once for the module on the Ray this folder's tests share (conftest.py's
``ray_address``), which this process drives; every test talks to that one application.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from aitune_testkit import serving

from aitune.testing import assert_matches_eager
from aitune.torch.serving import ClientError

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.slow
APP = "aitune-test"
MODEL = "twoheads"  # the artifact's stem
MAX_BODY = 256 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url(artifact, ray_address):
    """``host:port`` of the one application every test of this module talks to."""
    import aitune_serve_ray

    serve.shutdown()  # another test's Serve (its own HTTP port) would keep this one's port from applying
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = aitune_serve_ray.deployment(
        "aitune_testkit.serving:build_two_heads",
        artifact,
        threads=1,
        batch_wait_timeout_s=0.05,
        max_body_bytes=MAX_BODY,
    )
    serve.run(app, name=APP, route_prefix="/")
    yield f"127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture
def client(url):
    client = httpclient.InferenceServerClient(url, network_timeout=60)
    yield client
    client.close()


def _eager(x: np.ndarray) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return serving.build_two_heads()(torch.from_numpy(x))


def _x(rows: int, seed: int = 0, length: int = serving.LENGTH) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, length, serving.FEATURES)).astype(np.float32)


def _infer(client, x: np.ndarray, *, binary: bool = True, outputs=None, name: str = "x", datatype: str = "FP32"):
    tensor = httpclient.InferInput(name, list(x.shape), datatype)
    tensor.set_data_from_numpy(x, binary_data=binary)
    wanted = [httpclient.InferRequestedOutput(o, binary_data=binary) for o in outputs] if outputs else None
    return client.infer(MODEL, [tensor], outputs=wanted)


def _stats() -> dict:
    return serve.get_app_handle(APP).stats.remote().result(timeout_s=60)


def test_live_ready_and_metadata_from_the_tuned_graph(client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    meta = client.get_model_metadata(MODEL)
    assert meta["name"] == MODEL
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 8, 16]}]
    assert {o["name"]: (o["datatype"], o["shape"]) for o in meta["outputs"]} == {
        "logits": ("FP32", [-1, 4]),
        "pooled": ("FP32", [-1, 32]),
    }


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_inference_equals_eager_within_the_tuned_batch_sizes(client, binary):
    before = len(_stats()["batch_sizes"])
    for rows in (1, 3, 7):  # below, inside and above the tuned sizes 2..4
        x = _x(rows, seed=rows)
        result = _infer(client, x, binary=binary)
        got = {name: torch.tensor(result.as_numpy(name)) for name in ("logits", "pooled")}
        assert_matches_eager(got, _eager(x))
        parameters = result.get_response()["parameters"]
        assert parameters["aitune_backend"] == "encoder=onnxruntime"
        assert "aitune_eager_reason" not in parameters
    sizes = _stats()["batch_sizes"][before:]
    assert sizes and all(2 <= s <= 4 for s in sizes), sizes  # one row padded to 2; seven split 4 + 3


def test_output_selection_returns_only_what_was_asked(client):
    x = _x(2)
    result = _infer(client, x, outputs=["pooled"])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["pooled"]
    assert result.as_numpy("logits") is None
    assert_matches_eager(torch.tensor(result.as_numpy("pooled")), _eager(x)["pooled"])


def test_an_input_outside_the_tuned_shapes_runs_eager_and_says_why(client):
    x = _x(1, length=5)  # tuned for length 8
    result = _infer(client, x, outputs=["logits"])
    assert_matches_eager(torch.tensor(result.as_numpy("logits")), _eager(x)["logits"])
    parameters = result.get_response()["parameters"]
    assert parameters["aitune_backend"] == "encoder=torch_eager"
    assert "axis 1 is 5, tuned for the static size 8" in parameters["aitune_eager_reason"]


@pytest.mark.parametrize(
    ("send", "said"),
    [
        (dict(x=_x(2).astype(np.float64), datatype="FP64"), "this model takes FP32"),
        (dict(x=_x(2)[0]), "has rank 2, this model takes [-1, 8, 16]"),
        (dict(x=_x(2), name="y"), "unknown input 'y'; this model takes: x (FP32 [-1, 8, 16])"),
        (dict(x=_x(2), outputs=["nope"]), "unknown output 'nope'; this model answers: logits, pooled"),
        (dict(x=_x(40)), "40 rows in one request; this server takes at most 32"),
    ],
    ids=["dtype", "rank", "input-name", "output-name", "rows"],
)
def test_a_client_error_is_a_400_that_says_what_to_send(client, send, said):
    x = send.pop("x")
    with pytest.raises(InferenceServerException) as raised:
        _infer(client, x, **send)
    assert raised.value.status() == "400", raised.value
    assert said in raised.value.message()


@pytest.mark.parametrize(
    ("body", "headers"), list(serving.MALFORMED_BODIES.values()), ids=list(serving.MALFORMED_BODIES)
)
def test_a_malformed_body_is_a_4xx_not_a_500(url, body, headers):
    request = urllib.request.Request(f"http://{url}/v2/models/{MODEL}/infer", data=body, headers=headers, method="POST")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=30)
    assert 400 <= raised.value.code < 500, raised.value.read()
    assert json.loads(raised.value.read()), "the answer says what was wrong"


def test_a_body_over_the_cap_is_a_413_as_it_streams_in(url):
    """The kserve engine's body limits in front of the replica's app: declared or chunked, a body past
    ``max_body_bytes`` is refused with the protocol's error body once that many bytes came."""
    target = f"http://{url}/v2/models/{MODEL}/infer"

    def chunks():
        for _ in range(64):
            yield b"0" * 8192  # 512 KiB in all, no Content-Length

    for data in (b"0" * (2 * MAX_BODY), chunks()):
        request = urllib.request.Request(target, data=data, method="POST")
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request, timeout=30)
        assert raised.value.code == 413, raised.value.read()
        assert "the request body is too large" in json.loads(raised.value.read())["error"]


def test_concurrent_requests_join_batches_within_the_tuned_sizes(url):
    """Eight clients at once, one row each: Ray Serve's batches join them, never past the tuned 4 rows."""
    before = len(_stats()["batch_sizes"])
    client = httpclient.InferenceServerClient(url, concurrency=8, network_timeout=60)
    try:
        joined = []
        xs = [_x(1, seed=i) for i in range(24)]
        pending = []
        for x in xs:
            tensor = httpclient.InferInput("x", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            pending.append(client.async_infer(MODEL, [tensor], outputs=[httpclient.InferRequestedOutput("logits")]))
        for x, request in zip(xs, pending):
            result = request.get_result()
            assert_matches_eager(torch.tensor(result.as_numpy("logits")), _eager(x)["logits"])
            joined.append(result.get_response()["parameters"]["aitune_requests_joined"])
    finally:
        client.close()
    assert max(joined) > 1, "no two requests ever shared a model call"
    sizes = _stats()["batch_sizes"][before:]
    assert sizes and all(2 <= s <= 4 for s in sizes), sizes


def test_another_deployment_calls_the_model_through_its_handle(url):
    """``infer`` on the handle: named arrays in, named arrays out, through the same checks and batches."""
    handle = serve.get_app_handle(APP)
    x = _x(3, seed=9)
    got = handle.infer.remote({"x": x}).result(timeout_s=60)
    assert set(got) == {"logits", "pooled"}
    assert_matches_eager({k: torch.tensor(v) for k, v in got.items()}, _eager(x))
    only = handle.infer.remote({"x": torch.from_numpy(x)}, ["pooled"]).result(timeout_s=60)
    assert list(only) == ["pooled"]
    with pytest.raises(ClientError, match="unknown input 'y'"):  # no kserve needed to catch it
        handle.infer.remote({"y": x}).result(timeout_s=60)


BASELINES = {
    "eager": ({"eager": True}, "eager (no tuned module ran)", 2),  # the same batching: one row padded to 2
    "unbatched": ({"batching": False}, "encoder=torch_eager", 1),  # one row as sent, below the tuned 2..4: eager
}
"""Each baseline's options, the backend it answers with and the batch size one row runs at."""


@pytest.fixture(scope="module")
def baselines(url, artifact):
    """The baselines, one application each under its own route, deployed together (their replicas
    start side by side, beside the module's replica on Ray's two CPUs; the killed-replica test picks
    the module's own replica by its application's name)."""
    import aitune_serve_ray

    targets = [
        serve.RunTarget(
            aitune_serve_ray.deployment(
                "aitune_testkit.serving:build_two_heads",
                artifact,
                name=name,
                threads=1,
                ray_actor_options={"num_cpus": 0.5},
                **options,
            ),
            name=name,
            route_prefix=f"/{name}",
        )
        for name, (options, _, _) in BASELINES.items()
    ]
    serve.run_many(targets)  # taken down with the module's Serve (url's serve.shutdown), all at once


@pytest.mark.parametrize("name", list(BASELINES))
def test_the_baselines_answer_the_same_protocol(url, baselines, name):
    _, backend, batch_size = BASELINES[name]
    client = httpclient.InferenceServerClient(f"{url}/{name}", network_timeout=60)
    try:
        x = _x(1, seed=6)
        tensor = httpclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(name, [tensor])
    finally:
        client.close()
    assert_matches_eager(torch.tensor(result.as_numpy("logits")), _eager(x)["logits"])
    parameters = result.get_response()["parameters"]
    assert parameters["aitune_backend"] == backend and parameters["aitune_batch_size"] == batch_size, parameters


def test_a_killed_replica_is_replaced_and_serves_again(client):
    pid = _stats()["pid"]
    actors = ray.util.list_named_actors(all_namespaces=True)
    [name] = [a["name"] for a in actors if f"::{APP}#TunedModel#" in a["name"]]  # not the baselines' replicas
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    x = _x(1, seed=4)
    deadline = time.monotonic() + 120
    while True:
        try:
            result = _infer(client, x, outputs=["logits"])
            break
        except Exception:  # the proxy's 500 (or no replica yet) until the new replica is up
            assert time.monotonic() < deadline, "no new replica answered within 120 s"
            time.sleep(0.5)
    assert_matches_eager(torch.tensor(result.as_numpy("logits")), _eager(x)["logits"])
    assert _stats()["pid"] != pid


def test_deployment_options_reach_ray_serve_and_threads_set_the_cpus(artifact):
    import aitune_serve_ray

    autoscaling = {"min_replicas": 1, "max_replicas": 3}
    app = aitune_serve_ray.deployment(
        "aitune_testkit.serving:build_two_heads",
        artifact,
        threads=2,
        deployment_options={"autoscaling_config": autoscaling},
    )
    bound = app._bound_deployment  # Ray Serve has no public accessor for a bound application's options
    assert bound._deployment_config.autoscaling_config.max_replicas == 3
    assert bound.ray_actor_options["num_cpus"] == 2
    with pytest.raises(FileNotFoundError, match="no such artifact"):
        aitune_serve_ray.deployment("aitune_testkit.serving:build_two_heads", artifact.parent / "missing.ait")
    with pytest.raises(ValueError, match="give ait.load's options once"):
        aitune_serve_ray.deployment("m:b", artifact, load_options={"check": False}, trust_native_code=True)


def test_building_the_application_imports_no_kserve(artifact):
    """kserve is imported in the replicas only: a driver that also holds Triton's gRPC client, whose
    protocol buffers share kserve's names, builds and calls the application."""
    import subprocess
    import sys

    check = (
        "import sys, aitune_serve_ray\n"
        f"aitune_serve_ray.deployment('aitune_testkit.serving:build_two_heads', {str(artifact)!r})\n"
        f"aitune_serve_ray.app({{'artifact': {str(artifact)!r}, 'factory': 'm:b'}})\n"
        "assert 'kserve' not in sys.modules, sorted(m for m in sys.modules if m.startswith('kserve'))\n"
    )
    subprocess.run([sys.executable, "-c", check], check=True, timeout=180)


def test_stalled_uploads_hold_no_slot_another_request_needs(url):
    """70 connections that send headers and one body byte, then nothing: a request sent after them is
    answered while they are all still open (none has had its 408 yet), not after their timeout."""
    host, port = url.split(":")
    stalled = []
    try:
        for _ in range(70):
            sock = socket.create_connection((host, int(port)))
            sock.sendall(
                f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: 1000\r\n\r\n{".encode()
            )
            stalled.append(sock)
        body = {"inputs": [{"name": "x", "shape": [2, 8, 16], "datatype": "FP32", "data": [0.5] * 256}]}
        request = urllib.request.Request(
            f"http://{url}/v2/models/{MODEL}/infer", data=json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert answer.status == 200
        for sock in stalled:  # still waiting: the answer above did not wait for them to time out
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)
    finally:
        for sock in stalled:
            sock.close()
