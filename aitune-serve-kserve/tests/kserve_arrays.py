"""Tensors in and out of the protocol's numpy arrays: a request's checks on the array, a bfloat16
input made from the FP32 the protocol sends, and answers handed over without a copy where they can be.

Run in a process of its own by test_kserve_arrays.py: kserve and tritonclient.grpc, which other tests
import, cannot share one (both register the protocol's protobuf messages)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from aitune.torch.serving import BatchPlan, BatchRunner, InputSpec
from aitune_serve_kserve._kserve import InferInput, InferRequest, InvalidInput
from aitune_serve_kserve.model import TunedModel, _host_array
from aitune_serve_kserve.plan import DATATYPES, NUMPY_DATATYPES


def _model(**inputs: InputSpec) -> TunedModel:
    """A TunedModel with these inputs, as ``load()`` would have set them (no artifact is read)."""
    model = TunedModel("m", "aitune.demo:build_model", "m.ait")
    model._take_inputs(inputs, {n: 8 for n in inputs})
    return model


def _request(**arrays: np.ndarray) -> InferRequest:
    items = []
    for name, array in arrays.items():
        item = InferInput(name, list(array.shape), NUMPY_DATATYPES[array.dtype])
        item.set_data_from_numpy(array, binary_data=False)
        items.append(item)
    return InferRequest("m", items)


def test_a_request_is_checked_on_its_arrays_and_a_bfloat16_input_made_from_fp32():
    model = _model(
        ids=InputSpec("ids", True, torch.int64, (-1, 4)), scale=InputSpec("scale", True, torch.bfloat16, (-1, 4))
    )
    arrays = model.decode(_request(ids=np.arange(8).reshape(2, 4), scale=np.full((2, 4), 0.5, np.float32)))
    assert arrays["ids"].dtype == np.int64 and arrays["ids"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # the arrays stay as decoded; a call that needs tensors gets them from the runner, bfloat16 made from FP32
    runner = BatchRunner(torch.nn.Identity(), BatchPlan(((1, 8),)), model.inputs)
    tensors = runner._tensors(arrays)
    assert tensors["ids"].dtype == torch.int64 and tensors["ids"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert tensors["scale"].dtype == torch.bfloat16 and tensors["scale"].float().eq(0.5).all()
    with pytest.raises(InvalidInput, match=r"ids: shape \[2, 4, 1\] has rank 3"):
        model.decode(_request(ids=np.zeros((2, 4, 1), np.int64), scale=np.zeros((2, 4), np.float32)))
    with pytest.raises(InvalidInput, match="holds 12 elements per row; this server takes at most 8"):
        model.decode(_request(ids=np.zeros((2, 12), np.int64), scale=np.zeros((2, 12), np.float32)))
    with pytest.raises(InvalidInput, match="disagree on the batch size"):
        model.decode(_request(ids=np.zeros((2, 4), np.int64), scale=np.zeros((3, 4), np.float32)))


def test_every_protocol_datatype_has_its_numpy_dtype():
    for dtype in (d for d in DATATYPES if d != torch.bfloat16):
        array = torch.zeros(2, dtype=dtype).numpy()
        assert NUMPY_DATATYPES[array.dtype] == DATATYPES[dtype], dtype


def test_an_answer_on_the_host_is_handed_over_without_a_copy_and_any_other_made_into_one():
    plain = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert np.shares_memory(_host_array(plain), plain.numpy())
    widened = _host_array(plain.to(torch.bfloat16))
    assert widened.dtype == np.float32 and widened.tolist() == plain.tolist()
    assert _host_array(plain.clone().requires_grad_()).tolist() == plain.tolist()
    answered = np.arange(4.0)  # an answer from host arrays: as it is
    assert _host_array(answered) is answered
    transposed = _host_array(plain.t())
    assert transposed.tobytes() == plain.t().contiguous().numpy().tobytes()  # what the binary protocol sends


def test_a_request_to_a_tuned_onnx_runtime_graph_is_answered_from_its_arrays():
    """The server's request reaches ONNX Runtime as the arrays kserve decoded, never as torch tensors:
    rows of a tuned size as sent, rows padded up to one, rows cut into two calls; each answers as eager."""
    import asyncio

    import kserve_testmodel

    from aitune.testing import assert_matches_eager

    model = TunedModel("twoheads", "kserve_testmodel:build", ARTIFACT)
    model.load()
    graphs = model.batcher.runner.model.tuned_graphs  # type: ignore[union-attr]
    [(_, backend)] = graphs
    host_calls = []
    infer_host = backend.infer_host
    backend.infer_host = lambda arrays: host_calls.append(rows) or infer_host(arrays)
    eager = kserve_testmodel.build()
    for rows, host_calls_made in ((3, 1), (1, 1), (7, 2)):  # inside the tuned 2..4; padded to 2; 4 and 3
        x = np.random.default_rng(rows).standard_normal((rows, 8, 16)).astype(np.float32)
        item = InferInput("x", list(x.shape), "FP32")
        item.set_data_from_numpy(x, binary_data=False)
        response = asyncio.run(model.predict(InferRequest("twoheads", [item])))
        got = {o.name: torch.from_numpy(o.as_numpy()) for o in response.outputs}
        with torch.no_grad():
            assert_matches_eager(got, eager(torch.from_numpy(x)))
        assert response.parameters["aitune_backend"] == "model=onnxruntime", response.parameters
        assert response.parameters["aitune_batch_size"] == {3: 3, 1: 2, 7: 4}[rows]
        assert host_calls.count(rows) == host_calls_made, (rows, host_calls)


ARTIFACT = sys.argv[1] if len(sys.argv) > 1 else ""

if __name__ == "__main__":
    for name, check in list(globals().items()):
        if name.startswith("test_") and callable(check):
            check()
            print("passed", name)
