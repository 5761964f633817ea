"""Requests of different lengths joined into one call, padded, each answer cut back to its own length:
a tiny BERT tuned whole with ``ait.tune(..., pad=...)``, served by ``aitune serve``, driven by Triton's
own client."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from aitune.testing import assert_matches_eager

httpclient = pytest.importorskip("tritonclient.http")
pytest.importorskip("transformers")
import kserve_bert  # noqa: E402
from kserve_harness import Server, running  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "bert"


@pytest.fixture(scope="module")
def bert_server(tmp_path_factory) -> Iterator[Server]:
    pytest.importorskip("aitune_backend_onnxruntime")
    artifact = kserve_bert.tune(tmp_path_factory.mktemp("bert") / "bert.ait")
    with running(artifact, tmp_path_factory.mktemp("log") / "serve.log", factory="kserve_bert:build") as server:
        server.wait_ready(MODEL)
        yield server


def _eager(request: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = kserve_bert.build()(**{k: torch.from_numpy(v) for k, v in request.items()})
    return {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output}


def _inputs(request: dict[str, np.ndarray]) -> list:
    tensors = []
    for name, array in request.items():
        tensor = httpclient.InferInput(name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array, binary_data=True)
        tensors.append(tensor)
    return tensors


def _request(length: int, seed: int, padded: int = 1) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in kserve_bert.tokens(1, length, seed=seed, padded=padded).items()}


def _check(result, request: dict[str, np.ndarray]) -> dict:
    length = request["input_ids"].shape[1]
    got = {name: torch.from_numpy(result.as_numpy(name)) for name in ("last_hidden_state", "pooler_output")}
    assert got["last_hidden_state"].shape == (1, length, 32)  # cut back to its own length
    assert_matches_eager(got, _eager(request))
    return result.get_response()["parameters"]


def test_requests_of_lengths_5_and_9_join_one_call_and_answer_as_eager(bert_server):
    client = httpclient.InferenceServerClient(bert_server.url, concurrency=16)
    try:
        mixed = []  # (joined, padded to) of the length-5 answers
        for round_ in range(10):
            requests = [_request(5 if i % 2 else 9, seed=100 * round_ + i) for i in range(64)]
            pending = [client.async_infer(MODEL, _inputs(r)) for r in requests]
            results = [call.get_result() for call in pending]  # all answered before anything is checked
            for request, result in zip(requests, results):
                parameters = _check(result, request)
                assert parameters["aitune_backend"].startswith("bert="), parameters
                assert parameters["aitune_padding"] == "input_ids=0, attention_mask=0"
                if request["input_ids"].shape[1] == 5:
                    mixed.append((parameters["aitune_requests_joined"], parameters["aitune_padded_to"]))
            if any(joined > 1 and to.endswith("=9") for joined, to in mixed):
                break
    finally:
        client.close()
    assert any(joined > 1 and to.endswith("=9") for joined, to in mixed), mixed[:10]


def test_an_unpadded_sentence_is_served_by_the_tuned_backend(bert_server):
    client = httpclient.InferenceServerClient(bert_server.url)
    try:
        request = _request(7, seed=3, padded=0)  # an all-ones mask
        parameters = _check(client.infer(MODEL, _inputs(request)), request)
    finally:
        client.close()
    assert parameters["aitune_backend"] == "bert=onnxruntime", parameters
    assert "aitune_eager_reason" not in parameters


def test_where_no_padding_is_known_the_answers_say_so(server):
    client = httpclient.InferenceServerClient(server.url)
    try:
        x = np.zeros((1, 8, 16), dtype=np.float32)
        tensor = httpclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        parameters = client.infer("twoheads", [tensor]).get_response()["parameters"]
    finally:
        client.close()
    assert parameters["aitune_padding"].startswith("none: no padding is known"), parameters
    assert "aitune_padded_to" not in parameters
