"""A token id eager refuses (-1) gets a 4xx naming the input and the range it takes, on the kserve
engine: the ONNX Runtime payload would answer it (its Gather wraps -1), so the tuned module runs it
eager, eager raises, and the batcher makes that the client's error (kserve answers ``InvalidInput``
with 400, as it does every client error)."""

from __future__ import annotations

import numpy as np
import pytest
from kserve_harness import running

httpclient = pytest.importorskip("tritonclient.http")
import kserve_ids_model  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.slow


def _infer(client, ids: np.ndarray):
    tensor = httpclient.InferInput("input_ids", list(ids.shape), "INT64")
    tensor.set_data_from_numpy(ids)
    return client.infer("tokens", [tensor])


def test_id_minus_1_is_a_4xx_naming_input_ids_and_its_range(tmp_path):
    pytest.importorskip("aitune_backend_onnxruntime")
    artifact = kserve_ids_model.tune(tmp_path / "tokens.ait")
    with running(artifact, tmp_path / "serve.log", factory="kserve_ids_model:build") as server:
        server.wait_ready("tokens")
        client = httpclient.InferenceServerClient(server.url, network_timeout=60)
        try:
            ids = np.array([[49, 7, 8, 9, 10, 11]], dtype=np.int64)  # 49: an id tuning never saw
            assert _infer(client, ids).as_numpy("output").shape == (1, 3)
            ids[0, 0] = -1
            with pytest.raises(InferenceServerException) as raised:
                _infer(client, ids)
        finally:
            client.close()
    assert raised.value.status() == "400", raised.value
    said = raised.value.message()
    assert "input_ids holds a value outside 0..49" in said and "IndexError" in said, said
