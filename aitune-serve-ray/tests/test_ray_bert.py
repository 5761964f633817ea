"""Issue 52's whole-model BERT under ``aitune serve --engine ray`` with default options: the kserve
engine's tests' ``kserve_bert`` (the same artifact in one run: tuned once, saved unsigned as from the
README's install, so ``ait.load``'s check against eager runs in the replica), served by one command
joined to the Ray this folder's tests share (conftest.py's ``shared_ray``). It starts and answers as
eager, token id -1 is a 422 naming ``input_ids`` and its range, and 200k rows are refused by the row cap."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from aitune_testkit import docs
from aitune_testkit.serving import triton_inputs

from aitune.testing import assert_matches_eager

httpclient = pytest.importorskip("tritonclient.http")
pytest.importorskip("transformers")
from tritonclient.utils import InferenceServerException  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[2] / "aitune-serve-kserve" / "tests"))  # kserve_bert, shared
import kserve_bert  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "bert"  # the artifact's stem


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def bert(shared_ray, tmp_path_factory) -> Iterator[str]:
    """``host:port`` of ``aitune serve bert.ait --engine ray --address ... --factory kserve_bert:build
    --port ...``: no other option (no ``--threads``, no pin or check flag). The factory's module is
    put in the Ray's packages folder, as a user installs it on every node."""
    pytest.importorskip("aitune_backend_onnxruntime")
    from ray import serve

    artifact = kserve_bert.tuned(tmp_path_factory)
    shutil.copyfile(kserve_bert.__file__, shared_ray.packages / "kserve_bert.py")
    serve.shutdown()  # a running Serve keeps the HTTP port it started with
    port = _free_port()
    log = tmp_path_factory.mktemp("bert") / "serve.log"
    command = [sys.executable, "-m", "aitune", "serve", str(artifact), "--engine", "ray"]
    command += ["--address", shared_ray.address, "--factory", "kserve_bert:build", "--port", str(port)]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=shared_ray.packages)
    url = f"127.0.0.1:{port}"
    try:
        # bounded: a replica that cannot load ends the command (exit 1, one line)
        docs.wait_ready(process, url, [MODEL], 240, lambda: log.read_text()[-3000:])
        yield url
    finally:
        docs.stop(process, signal.SIGINT, timeout_s=180)  # Ctrl-C takes the application down; the shared Ray stays


def _tokens(rows: int, length: int, seed: int, padded: int) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in kserve_bert.tokens(rows, length, seed=seed, padded=padded).items()}


def _refusal(url: str, request: dict[str, np.ndarray]) -> InferenceServerException:
    client = httpclient.InferenceServerClient(url, network_timeout=60)
    try:
        with pytest.raises(InferenceServerException) as raised:
            client.infer(MODEL, triton_inputs(request))
    finally:
        client.close()
    return raised.value


def test_the_unsigned_bert_starts_with_default_options_and_answers_as_eager(bert, tmp_path_factory):
    """Issue 52's first failure: this BERT, unsigned, was refused in every replica by the check against
    eager (which filled the attention mask with zeros). Unsigned, the replica's ``ait.load`` checks
    the payload; it started, and the tuned payload answers as eager, padded or not."""
    assert not kserve_bert.signed(kserve_bert.tuned(tmp_path_factory))
    client = httpclient.InferenceServerClient(bert, network_timeout=60)
    try:
        for request in (_tokens(4, 12, seed=7, padded=2), _tokens(1, 7, seed=3, padded=0)):
            result = client.infer(MODEL, triton_inputs(request))
            got = {n: torch.tensor(result.as_numpy(n)) for n in ("last_hidden_state", "pooler_output")}
            assert_matches_eager(got, kserve_bert.eager(request))
            parameters = result.get_response()["parameters"]
            assert parameters["aitune_backend"] == "bert=onnxruntime", parameters
            assert "aitune_eager_reason" not in parameters
    finally:
        client.close()


def test_token_id_minus_1_is_a_422_naming_input_ids_and_its_range(bert):
    """ONNX Runtime's Gather answered -1 with row 999's answer (200); eager raises: the replica says
    which input holds a value outside the range tuning saw."""
    request = _tokens(1, 6, seed=5, padded=1)
    request["input_ids"][0, 2] = -1
    refused = _refusal(bert, request)
    assert refused.status() == "422", refused  # the request fits the inputs: its values do not
    said = refused.message()
    assert "input_ids holds a value outside 0..99" in said and "IndexError" in said, said


def test_200k_rows_are_refused_by_the_row_cap_before_the_model_runs(bert):
    """0.41 MB of token ids once made a 417 MB answer, and a 200k-row request held a small one behind
    it for 7.3 s: 200k rows (of 4 tokens) are refused by the row cap, the model never called."""
    from ray import serve

    stats = serve.get_app_handle("aitune").stats  # the application `aitune serve` deploys
    calls = len(stats.remote().result(timeout_s=60)["batch_sizes"])
    request = {"input_ids": np.ones((200_000, 4), np.int64), "attention_mask": np.ones((200_000, 4), np.int64)}
    refused = _refusal(bert, request)
    assert refused.status() == "400", refused
    assert "200000 rows in one request; this server takes at most 32" in refused.message(), refused.message()
    assert len(stats.remote().result(timeout_s=60)["batch_sizes"]) == calls, "the model ran"
