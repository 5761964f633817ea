"""Request bodies and their errors, and the runner answering with this engine's BadRequest: no Ray needed.

The plan and the runner themselves are every engine's: aitune-core/tests/test_serving.py."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from aitune_testkit import serving

import aitune.torch as ait
from aitune.torch.serving import BatchPlan, InputSpec, input_specs
from aitune_serve_ray.batching import BatchRunner
from aitune_serve_ray.codec import BadRequest, decode, encode

TOL = 1e-4


@pytest.fixture
def loaded(artifact):
    return ait.load(serving.build(), artifact)


# -- bodies ------------------------------------------------------------------------------------------------

SPECS = {"x": InputSpec("x", True, torch.float32, 3, 0)}
IDS = {"ids": InputSpec("ids", True, torch.int64, 2, 0)}


def _npy(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_json_numbers_become_the_tuned_dtype():
    [[x]] = [list(decode(json.dumps({"x": [[[1, 2]]]}).encode(), "application/json", SPECS).values())]
    assert x.dtype == torch.float32 and x.tolist() == [[[1.0, 2.0]]]


@pytest.mark.parametrize(
    ("body", "content_type", "specs", "status", "words"),
    [
        (b'{"y": [[[1.0]]]}', "application/json", SPECS, 422, "unknown input 'y'; this model takes: x"),
        (b"{}", "application/json", SPECS, 422, "missing input 'x'"),
        (b'{"x": [[1.0]]}', "application/json", SPECS, 422, "rank 2, this model takes rank 3"),
        (b'{"x": [[[1.0], [1.0, 2.0]]]}', "application/json", SPECS, 422, "ragged"),
        (b'{"ids": [[0.5]]}', "application/json", IDS, 422, "floating-point values, this model takes int64"),
        (b'{"x": [[["a"]]]}', "application/json", SPECS, 422, "expected numbers"),
        (b"not json", "application/json", SPECS, 400, "not JSON"),
        (b"[1, 2]", "application/json", SPECS, 400, "send a JSON object"),
        (_npy(np.zeros((1, 8, 16))), "application/x-npy", SPECS, 422, "dtype float64, this model takes float32"),
        (b"\x93NUMPY garbage", "application/x-npy", SPECS, 400, "not a .npy"),
        (b"garbage", "application/safetensors", SPECS, 400, "not safetensors"),
        (b"x", "text/plain", SPECS, 415, "application/json"),
        (b'{"x": []}', "application/json", SPECS, 422, "rank 1"),
    ],
)
def test_a_bad_request_says_what_was_wrong(body, content_type, specs, status, words):
    with pytest.raises(BadRequest) as caught:
        decode(body, content_type, specs)
    assert caught.value.status == status
    assert words in caught.value.message, caught.value.message


def test_npy_and_safetensors_round_trip():
    from safetensors.torch import load, save

    x = torch.randn(2, 8, 16)
    assert torch.equal(decode(_npy(x.numpy()), "application/x-npy", SPECS)["x"], x)
    assert torch.equal(decode(save({"x": x}), "application/safetensors", SPECS)["x"], x)
    body, kind = encode({"output": x}, "application/safetensors")
    assert kind == "application/safetensors" and torch.equal(load(body)["output"], x)
    body, kind = encode({"output": x}, "application/x-npy")
    assert torch.equal(torch.from_numpy(np.load(io.BytesIO(body))), x)
    with pytest.raises(BadRequest) as caught:
        encode({"a": x, "b": x}, "application/x-npy")
    assert caught.value.status == 406


# -- the runner --------------------------------------------------------------------------------------------


def _runner(model):
    calls = []
    return BatchRunner(model, BatchPlan.of(model), input_specs(model), on_call=calls.append), calls


def test_joined_requests_answer_as_eager_and_every_call_stays_in_the_tuned_range(loaded):
    runner, calls = _runner(loaded)
    eager = serving.build()
    requests = [{"x": torch.randn(rows, 8, 16)} for rows in (1, 2, 1, 5, 4)]
    answers = runner.run(requests)
    for request, answer in zip(requests, answers):
        with torch.no_grad():
            assert torch.allclose(answer.outputs["output"], eager(request["x"]), atol=TOL)
        assert answer.backends == ("encoder=onnxruntime",) and answer.eager_reasons == ()
    assert sum(c.rows for c in calls) == 13 and all(2 <= c.size <= 4 for c in calls), calls
    assert [(c.rows, c.size) for c in calls] == [(4, 4), (4, 4), (4, 4), (1, 2)]  # the last one padded


def test_a_request_outside_the_tuned_shapes_runs_eager_and_says_why(loaded):
    runner, _ = _runner(loaded)
    x = torch.randn(1, 5, 16)  # tuned for length 8
    with pytest.warns(RuntimeWarning, match="outside what was tuned"):
        [answer] = runner.run([{"x": x}])
    with torch.no_grad():
        assert torch.allclose(answer.outputs["output"], serving.build()(x), atol=TOL)
    assert answer.backends == ("encoder=torch_eager",)
    assert "axis 1 is 5, tuned for the static size 8" in answer.eager_reasons[0]


def test_a_request_the_model_cannot_take_fails_alone(loaded):
    runner, _ = _runner(loaded)
    good = {"x": torch.randn(1, 8, 16)}
    with pytest.warns(RuntimeWarning, match="outside what was tuned"):
        bad, answered = runner.run([{"x": torch.randn(1, 8, 24)}, good])
    assert isinstance(bad, BadRequest) and bad.status == 422
    assert "axis 2 is 24" in bad.message and "RuntimeError" in bad.message, bad.message
    with torch.no_grad():
        assert torch.allclose(answered.outputs["output"], serving.build()(good["x"]), atol=TOL)


def test_a_failure_of_the_server_itself_is_not_blamed_on_the_request(loaded):
    runner, _ = _runner(loaded)

    class Broken(torch.nn.Module):
        def forward(self, x):
            raise MemoryError("out of memory")

    runner.model = Broken()
    with pytest.raises(MemoryError):
        runner.run([{"x": torch.randn(2, 8, 16)}])
