"""The deployment on a real local Ray Serve: one replica, loopback only, a bounded number of requests.

Ray and Serve start once for the module (about 15 s); every test talks HTTP to 127.0.0.1.
"""

from __future__ import annotations

import concurrent.futures
import io
import shutil
import socket
import tempfile
import time

import numpy as np
import pytest
import torch
from aitune_testkit import serving

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
requests = pytest.importorskip("requests")

pytestmark = pytest.mark.slow
TOL = 1e-4
APP = "aitune-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url(artifact):
    import aitune_serve_ray

    # a folder of its own under /tmp: nox points TMPDIR into the virtualenv, too long for Ray's sockets
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = aitune_serve_ray.deployment("aitune_testkit.serving:build", artifact, threads=1, batch_wait_timeout_s=0.05)
    serve.run(app, name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{port}/"
    serve.shutdown()
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def _eager(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return serving.build()(x)


def _post(url: str, x: torch.Tensor, **kw) -> requests.Response:
    return requests.post(url, json={"x": x.tolist()}, timeout=60, **kw)


def _stats() -> dict:
    return serve.get_app_handle(APP).stats.remote().result(timeout_s=60)


def test_get_says_what_it_takes_and_the_tuned_batch_sizes(url):
    info = requests.get(url, timeout=60).json()
    assert info["inputs"] == {"x": {"dtype": "float32", "rank": 3, "batch_axis": 0, "required": True}}
    assert info["tuned_batch_sizes"] == [[2, 4]] and info["threads"] == 1


def test_single_and_concurrent_requests_answer_as_eager_within_the_tuned_range(url):
    before = len(_stats()["batch_sizes"])
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(rows, 8, 16, generator=g) for rows in (1, 1, 2, 3, 1, 6, 1, 1)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda x: _post(url, x), xs))
    for x, answer in zip(xs, answers):
        assert answer.status_code == 200, answer.text
        assert torch.allclose(torch.tensor(answer.json()["output"]), _eager(x), atol=TOL)
        assert answer.headers["x-aitune-backend"] == "encoder=onnxruntime"
        assert "x-aitune-eager-reason" not in answer.headers
        assert all(2 <= int(s) <= 4 for s in answer.headers["x-aitune-batch-size"].split(", "))
    stats = _stats()
    sizes = stats["batch_sizes"][before:]
    assert sizes and all(2 <= s <= 4 for s in sizes), sizes
    assert stats["batches_by_backend"]["encoder=onnxruntime"] >= len(sizes)


def test_binary_bodies_in_and_out(url):
    from safetensors.torch import load, save

    x = torch.randn(2, 8, 16)
    buffer = io.BytesIO()
    np.save(buffer, x.numpy())
    answer = requests.post(url, data=buffer.getvalue(), headers={"content-type": "application/x-npy"}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/x-npy"
    assert torch.allclose(torch.from_numpy(np.load(io.BytesIO(answer.content))), _eager(x), atol=TOL)
    answer = requests.post(
        url,
        data=save({"x": x}),
        headers={"content-type": "application/safetensors", "accept": "application/json"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert torch.allclose(torch.tensor(answer.json()["output"]), _eager(x), atol=TOL)
    answer = _post(url, x, headers={"accept": "application/safetensors"})
    assert torch.allclose(load(answer.content)["output"], _eager(x), atol=TOL)


def test_an_input_outside_the_tuned_shapes_is_answered_eager_with_the_reason(url):
    before = _stats()["eager_fallbacks"]
    x = torch.randn(1, 5, 16)  # tuned for length 8
    answer = _post(url, x)
    assert answer.status_code == 200, answer.text
    assert torch.allclose(torch.tensor(answer.json()["output"]), _eager(x), atol=TOL)
    assert answer.headers["x-aitune-backend"] == "encoder=torch_eager"
    assert "axis 1 is 5, tuned for the static size 8" in answer.headers["x-aitune-eager-reason"]
    after = _stats()["eager_fallbacks"]
    assert sum(after.values()) == sum(before.values()) + 1


@pytest.mark.parametrize(
    ("body", "headers", "status", "words"),
    [
        (b'{"y": [[[1.0]]]}', {}, 422, "unknown input 'y'"),
        (b'{"x": [[1.0]]}', {}, 422, "rank 2, this model takes rank 3"),
        (b'{"x": [[[1.0], [1.0, 2.0]]]}', {}, 422, "ragged"),
        (b"{not json", {}, 400, "not JSON"),
        (b"x", {"content-type": "text/csv"}, 415, "application/json"),
        (b'{"x": ' + str(torch.zeros(1, 8, 24).tolist()).encode() + b"}", {}, 422, "axis 2 is 24"),
    ],
)
def test_bad_input_is_a_4xx_with_a_message_never_a_traceback(url, body, headers, status, words):
    answer = requests.post(url, data=body, headers={"content-type": "application/json", **headers}, timeout=60)
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]
    assert "Traceback" not in answer.text


def test_another_method_is_a_405_that_names_post_and_get(url):
    answer = requests.put(url, json={"x": [[[0.0] * 16] * 8]}, timeout=60)
    assert answer.status_code == 405 and "POST tensors" in answer.json()["error"]


def test_a_killed_replica_is_replaced_and_serves_again(url):
    pid = _stats()["pid"]
    [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "TunedModel" in a["name"]]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    x = torch.randn(1, 8, 16)
    deadline = time.monotonic() + 120
    while True:
        try:
            answer = _post(url, x)
            if answer.status_code == 200:
                break
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, "no new replica answered within 120 s"
        time.sleep(0.5)
    assert torch.allclose(torch.tensor(answer.json()["output"]), _eager(x), atol=TOL)
    assert _stats()["pid"] != pid


def test_the_eager_baseline_keeps_the_batching_and_runs_no_tuned_backend(url, artifact):
    from aitune_serve_ray import TunedModel

    replica = TunedModel.func_or_class("aitune_testkit.serving:build", str(artifact), 1, eager=True)
    x = torch.randn(1, 8, 16)
    [answer] = replica.runner.run([{"x": x}])
    assert torch.allclose(answer.outputs["output"], _eager(x), atol=TOL)
    assert answer.backends == () and answer.batch_sizes == (2,)  # padded to the tuned batch sizes all the same
    unbatched = TunedModel.func_or_class("aitune_testkit.serving:build", str(artifact), 1, batching=False)
    with pytest.warns(RuntimeWarning, match="outside what was tuned"):
        [answer] = unbatched.runner.run([{"x": x}])  # one row, as sent: below the tuned 2..4
    assert answer.backends == ("encoder=torch_eager",) and answer.batch_sizes == (1,)


def test_deployment_options_reach_ray_serve_and_threads_set_the_cpus(artifact):
    import aitune_serve_ray

    autoscaling = {"min_replicas": 1, "max_replicas": 3}
    app = aitune_serve_ray.deployment(
        "aitune_testkit.serving:build", artifact, threads=2, deployment_options={"autoscaling_config": autoscaling}
    )
    bound = app._bound_deployment  # Ray Serve has no public accessor for a bound application's options
    assert bound._deployment_config.autoscaling_config.max_replicas == 3
    assert bound.ray_actor_options["num_cpus"] == 2
    with pytest.raises(FileNotFoundError, match="no such artifact"):
        aitune_serve_ray.deployment("aitune_testkit.serving:build", artifact.parent / "missing.ait")
