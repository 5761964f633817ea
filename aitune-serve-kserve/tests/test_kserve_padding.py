"""A tiny BERT tuned whole with ``ait.tune(..., pad=...)`` and saved unsigned, as from the README's
install, served by ``aitune serve`` with its default options, driven by Triton's own client: it starts
(``ait.load``'s check against eager passes), requests of different lengths join one call, padded, each
answer cut back to its own length, and the requests issue 52 found answered wrongly or too late are
refused (a token id eager refuses, 200k rows)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from aitune_testkit.serving import triton_inputs

from aitune.testing import assert_matches_eager

httpclient = pytest.importorskip("tritonclient.http")
pytest.importorskip("transformers")
import kserve_bert  # noqa: E402
from kserve_harness import Server, running  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "bert"


@pytest.fixture(scope="module")
def bert_server(tmp_path_factory) -> Iterator[Server]:
    """The one BERT server of this module: no option but the factory and the ports (no ``--threads``,
    no pin or check flag)."""
    pytest.importorskip("aitune_backend_onnxruntime")
    artifact = kserve_bert.tuned(tmp_path_factory)
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with running(artifact, log, factory="kserve_bert:build", threads=None) as server:
        server.wait_ready(MODEL)
        yield server


def _request(length: int, seed: int, padded: int = 1) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in kserve_bert.tokens(1, length, seed=seed, padded=padded).items()}


def _check(result, request: dict[str, np.ndarray]) -> dict:
    length = request["input_ids"].shape[1]
    got = {name: torch.from_numpy(result.as_numpy(name)) for name in ("last_hidden_state", "pooler_output")}
    assert got["last_hidden_state"].shape == (1, length, 32)  # cut back to its own length
    assert_matches_eager(got, kserve_bert.eager(request))
    return result.get_response()["parameters"]


def test_requests_of_lengths_5_and_9_join_one_call_and_answer_as_eager(bert_server):
    client = httpclient.InferenceServerClient(bert_server.url, concurrency=16)
    try:
        mixed = []  # (joined, padded to) of the length-5 answers
        for round_ in range(10):
            requests = [_request(5 if i % 2 else 9, seed=100 * round_ + i) for i in range(64)]
            pending = [client.async_infer(MODEL, triton_inputs(r)) for r in requests]
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
        parameters = _check(client.infer(MODEL, triton_inputs(request)), request)
    finally:
        client.close()
    assert parameters["aitune_backend"] == "bert=onnxruntime", parameters
    assert "aitune_eager_reason" not in parameters


def test_the_unsigned_bert_starts_with_default_options_its_payload_checked_against_eager(bert_server, tmp_path_factory):
    """Issue 52's first failure: this BERT, unsigned, was refused at load by the check against eager
    (which filled the attention mask with zeros). Unsigned, the check runs; the server started; the
    check compared the payload (no warning that it could not); the tuned payload answers as eager."""
    assert not kserve_bert.signed(kserve_bert.tuned(tmp_path_factory))
    assert "could not be compared" not in bert_server.log.read_text()
    client = httpclient.InferenceServerClient(bert_server.url)
    try:
        request = {k: v.numpy() for k, v in kserve_bert.tokens(4, 12, seed=7, padded=2).items()}
        result = client.infer(MODEL, triton_inputs(request))
    finally:
        client.close()
    got = {name: torch.from_numpy(result.as_numpy(name).copy()) for name in ("last_hidden_state", "pooler_output")}
    assert_matches_eager(got, kserve_bert.eager(request))
    assert result.get_response()["parameters"]["aitune_backend"] == "bert=onnxruntime"


def _refusal(server: Server, request: dict[str, np.ndarray]) -> InferenceServerException:
    client = httpclient.InferenceServerClient(server.url, network_timeout=60)
    try:
        with pytest.raises(InferenceServerException) as raised:
            client.infer(MODEL, triton_inputs(request))
    finally:
        client.close()
    return raised.value


def test_token_id_minus_1_is_a_422_naming_input_ids_and_its_range(bert_server):
    """ONNX Runtime's Gather would answer -1 with the last row's embedding; eager raises: the server
    says which input holds a value outside the range tuning saw."""
    request = _request(6, seed=5)
    request["input_ids"][0, 2] = -1
    refused = _refusal(bert_server, request)
    assert refused.status() == "422", refused  # the request fits the inputs: its values do not
    said = refused.message()
    assert "input_ids holds a value outside 0..99" in said and "IndexError" in said, said


def test_200k_rows_are_refused_by_the_row_cap_before_the_model_runs(bert_server):
    """0.41 MB of token ids once made a 417 MB answer and held other requests for seconds: 200k rows
    (of 4 tokens) are refused by the row cap, the model never called."""
    request = {"input_ids": np.ones((200_000, 4), dtype=np.int64), "attention_mask": np.ones((200_000, 4), np.int64)}
    refused = _refusal(bert_server, request)
    assert refused.status() == "400", refused
    assert "200000 rows in one request; this server takes at most 32" in refused.message(), refused.message()


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
