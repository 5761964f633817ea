"""``aitune serve`` on kserve's ModelServer, driven by Triton's own client (nobody here wrote it)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from aitune_testkit.serving import MALFORMED_BODIES

from aitune.testing import assert_matches_eager

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
import kserve_testmodel  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "twoheads"  # the artifact's stem


def _eager(x: np.ndarray) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return kserve_testmodel.build()(torch.from_numpy(x))


def _x(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 8, 16)).astype(np.float32)


def _infer(client, x: np.ndarray, *, binary: bool, outputs=None, name: str = "x", datatype: str = "FP32"):
    tensor = httpclient.InferInput(name, list(x.shape), datatype)
    tensor.set_data_from_numpy(x, binary_data=binary)
    wanted = [httpclient.InferRequestedOutput(o, binary_data=binary) for o in outputs] if outputs else None
    return client.infer(MODEL, [tensor], outputs=wanted)


@pytest.fixture
def client(server):
    client = httpclient.InferenceServerClient(server.url)
    yield client
    client.close()


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
def test_inference_equals_eager(client, binary):
    for rows in (1, 3, 7):  # below, inside and above the tuned sizes 2..4
        x = _x(rows, seed=rows)
        result = _infer(client, x, binary=binary)
        got = {name: torch.tensor(result.as_numpy(name)) for name in ("logits", "pooled")}
        assert_matches_eager(got, _eager(x))
        assert "model=onnxruntime" in result.get_response()["parameters"]["aitune_backend"]


def test_output_selection_returns_only_what_was_asked(client):
    x = _x(2)
    result = _infer(client, x, binary=True, outputs=["pooled"])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["pooled"]
    assert result.as_numpy("logits") is None
    assert_matches_eager(torch.tensor(result.as_numpy("pooled")), _eager(x)["pooled"])


def test_nan_in_a_json_answer_is_null_and_exact_in_a_binary_one(client):
    x = _x(2)
    x[1] = np.nan  # eager answers NaN for the second row (sent binary: JSON has no NaN)
    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    as_json = client.infer(MODEL, [tensor], outputs=[httpclient.InferRequestedOutput("logits", binary_data=False)])
    raw = json.dumps(as_json.get_response(), allow_nan=False)  # parsed as strict JSON: no bare NaN came
    assert "null" in raw
    as_binary = _infer(client, x, binary=True, outputs=["logits"])
    logits = as_binary.as_numpy("logits")
    assert np.isnan(logits[1]).all() and np.isfinite(logits[0]).all()


@pytest.mark.parametrize(
    ("send", "said"),
    [
        (dict(x=_x(2).astype(np.float64), datatype="FP64"), "this model takes FP32"),
        (dict(x=_x(2)[0], datatype="FP32"), "has rank 2, this model takes [-1, 8, 16]"),
        (dict(x=_x(2), name="y"), "unknown input 'y'; this model takes: x (FP32 [-1, 8, 16])"),
        (dict(x=_x(2), outputs=["nope"]), "unknown output 'nope'; this model answers: logits, pooled"),
        (dict(x=_x(40)), "40 rows in one request; this server takes at most 32"),
    ],
    ids=["dtype", "rank", "input-name", "output-name", "rows"],
)
def test_a_client_error_is_a_4xx_that_says_what_to_send(client, send, said):
    x = send.pop("x")
    with pytest.raises(InferenceServerException) as raised:
        _infer(client, x, binary=True, **send)
    assert raised.value.status() == "400", raised.value
    assert said in raised.value.message()


@pytest.mark.parametrize(("body", "headers"), list(MALFORMED_BODIES.values()), ids=list(MALFORMED_BODIES))
def test_a_malformed_body_is_a_4xx_not_a_500(server, body, headers):
    request = urllib.request.Request(
        f"http://{server.url}/v2/models/{MODEL}/infer", data=body, headers=headers, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=30)
    assert 400 <= raised.value.code < 500, raised.value.read()
    assert raised.value.read(), "the answer says what was wrong"


def test_concurrent_requests_join_one_call_within_the_tuned_sizes(server):
    """Eight clients at once, one row each: requests that queue while the model runs share a call."""
    client = httpclient.InferenceServerClient(server.url, concurrency=8)
    try:
        joined, sizes = [], []
        for _ in range(5):
            xs = [_x(1, seed=i) for i in range(64)]
            pending = [
                client.async_infer(MODEL, [_input(x)], outputs=[httpclient.InferRequestedOutput("logits")]) for x in xs
            ]
            for x, request in zip(xs, pending):
                result = request.get_result()
                assert_matches_eager(torch.tensor(result.as_numpy("logits")), _eager(x)["logits"])
                parameters = result.get_response()["parameters"]
                joined.append(parameters["aitune_requests_joined"])
                sizes.append(parameters["aitune_batch_size"])
            if max(joined) > 1:
                break
    finally:
        client.close()
    assert max(joined) > 1, "no two requests ever shared a model call"
    assert set(sizes) <= {2, 3, 4}, sizes  # one row is padded up to 2; never past the largest tuned 4
    metrics = urllib.request.urlopen(f"http://{server.url}/metrics", timeout=30).read().decode()
    assert 'aitune_serve_requests_per_call_count{model_name="twoheads"}' in metrics


def _input(x: np.ndarray):
    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    return tensor


def test_grpc_metadata_and_inference(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        assert client.is_model_ready(MODEL)
        meta = client.get_model_metadata(MODEL, as_json=True)
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "8", "16"]}]
        x = _x(3, seed=5)
        tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(MODEL, [tensor], outputs=[grpcclient.InferRequestedOutput("logits")])
        assert_matches_eager(torch.tensor(result.as_numpy("logits")), _eager(x)["logits"])
        assert result.as_numpy("pooled") is None
        bad = grpcclient.InferInput("x", [3, 16], "FP32")
        bad.set_data_from_numpy(x[:, 0])
        with pytest.raises(InferenceServerException) as raised:
            client.infer(MODEL, [bad])
        assert "INVALID_ARGUMENT" in str(raised.value.status()) and "rank 2" in raised.value.message()
    finally:
        client.close()


def test_the_model_name_is_the_artifact_stem_unless_named(server):
    listed = json.loads(urllib.request.urlopen(f"http://{server.url}/v2/models", timeout=30).read())
    assert listed["models"] == [MODEL]
