"""The external-data check of a loaded payload, read from the protobuf without ``onnx``.

The reader must find every external-data location that ONNX Runtime could open, wherever the tensor
sits, so the refusal of a graph pointing outside its payload holds as it did when ``onnx`` read it;
and a load of an ONNX Runtime artifact must not import ``onnx`` (0.4 s of a cold start).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import _get_all_tensors, uses_external_data

import aitune.torch as ait
from aitune.errors import SerializationError
from aitune.testing.conformance import run_in_fresh_process
from aitune_backend_onnxruntime import payload
from aitune_backend_onnxruntime.backend import ONNXRuntimeBackend


def _external(name: str, location: str, *more: tuple[str, str]) -> TensorProto:
    tensor = numpy_helper.from_array(np.zeros(4, dtype=np.float32), name)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "16"), *more):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _everywhere() -> onnx.ModelProto:
    """A model with an external tensor in every place a tensor can sit, each naming its own file."""
    then = helper.make_graph(
        [helper.make_node("Constant", [], ["t"], value=_external("sub_attr", "sub_attr.bin"))],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [4])],
        initializer=[_external("sub_init", "sub_init.bin")],
    )
    nodes = [
        helper.make_node("Constant", [], ["c"], value=_external("attr_t", "attr_t.bin")),
        helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=then),
        helper.make_node("Fn", ["c"], ["z"], domain="local"),
    ]
    attr = helper.make_attribute("tensors", [_external("attr_list", "attr_list.bin")])
    nodes[0].attribute.append(attr)
    sparse = onnx.SparseTensorProto()
    sparse.values.CopyFrom(_external("sparse_values", "sparse_values.bin"))
    sparse.indices.CopyFrom(numpy_helper.from_array(np.array([0], dtype=np.int64), "sparse_indices"))
    sparse.dims.extend([4])
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        initializer=[_external("init", "init.bin"), numpy_helper.from_array(np.ones(2, dtype=np.float32), "inline")],
        sparse_initializer=[sparse],
    )
    function = helper.make_function(
        "local",
        "Fn",
        ["a"],
        ["b"],
        [helper.make_node("Constant", [], ["b"], value=_external("fn_attr", "fn_attr.bin"))],
        [helper.make_opsetid("", 17)],
    )
    return helper.make_model(graph, functions=[function], opset_imports=[helper.make_opsetid("", 17)])


def test_every_external_tensor_is_found_where_onnx_finds_it_and_in_sparse_initializers():
    model = _everywhere()
    found = payload.external_locations(model.SerializeToString())
    by_onnx = {
        next(e.value for e in t.external_data if e.key == "location")
        for t in _get_all_tensors(model)
        if uses_external_data(t)
    }
    assert by_onnx == {"init.bin", "attr_t.bin", "attr_list.bin", "sub_init.bin", "sub_attr.bin", "fn_attr.bin"}
    assert set(found) == by_onnx | {"sparse_values.bin"}  # onnx's helper skips sparse initializers


def test_the_check_refuses_a_graph_pointing_outside_and_accepts_one_inside(tmp_path):
    model = _everywhere()
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    inside = [path.name, *payload.external_locations(path.read_bytes())]
    assert payload.external_data_outside(path, inside) is None
    for missing in inside[1:]:
        assert payload.external_data_outside(path, [f for f in inside if f != missing]) == missing


@pytest.mark.parametrize(
    ("tensor", "expected"),
    [
        (_external("w", "model.onnx.data", ("location", "/etc/passwd")), ["model.onnx.data", "/etc/passwd"]),
        (_external("w", "*/_ORT_MEM_ADDR_/*"), ["*/_ORT_MEM_ADDR_/*"]),
        (_external("w", "../elsewhere/model.onnx.data"), ["../elsewhere/model.onnx.data"]),
    ],
)
def test_every_location_entry_counts_as_onnx_runtime_takes_the_last(tensor, expected):
    graph = helper.make_graph([], "g", [], [], initializer=[tensor])
    assert payload.external_locations(helper.make_model(graph).SerializeToString()) == expected


def test_an_external_tensor_without_a_location_or_an_inline_one_with_a_location():
    nameless = _external("a", "x.bin")
    del nameless.external_data[0]  # offset and length only
    inline = _external("b", "y.bin")
    inline.data_location = TensorProto.DEFAULT  # ONNX Runtime reads no file for it
    graph = helper.make_graph([], "g", [], [], initializer=[nameless, inline])
    assert payload.external_locations(helper.make_model(graph).SerializeToString()) == [""]


@pytest.mark.parametrize(
    "data",
    [
        b"\x3a\xff\xff\xff\xff\x0f",  # graph field, length past the end
        b"\x3a\x02\x2a",  # a graph whose initializer is cut short
        b"\x0b",  # a group (wire type 3)
        b"\x80",  # a truncated varint
        b"\x00\x01",  # field number 0
    ],
)
def test_bytes_that_are_no_protobuf_are_refused(data):
    with pytest.raises(SerializationError, match="not a well-formed ONNX model"):
        payload.external_locations(data)


def _field(number: int, body: bytes) -> bytes:
    size, length = b"", len(body)
    while True:
        size += bytes([(length & 0x7F) | (0x80 if length > 0x7F else 0)])
        length >>= 7
        if not length:
            break
    return bytes([number << 3 | 2]) + size + body


def test_a_graph_nested_past_the_limit_is_refused():
    graph = b""  # written by hand: protobuf's own parser stops at 100 levels before the model is made
    for _ in range(payload.MAX_NESTING // 3 + 2):  # graph.node -> node.attribute -> attribute.g
        graph = _field(1, _field(5, _field(6, graph)))
    with pytest.raises(SerializationError, match="nested"):
        payload.external_locations(_field(7, graph))
    shallow = b""
    for _ in range(payload.MAX_NESTING // 3 - 2):
        shallow = _field(1, _field(5, _field(6, shallow)))
    assert payload.external_locations(_field(7, shallow)) == []


def test_loading_an_onnx_runtime_artifact_imports_no_onnx(tmp_path):
    torch.manual_seed(0)
    model = ait.Module(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval(),
        "mlp",
        strategy=ait.OneBackendStrategy(ONNXRuntimeBackend(), performance_validation=False),
    )
    ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
    path = tmp_path / "mlp.ait"
    ait.save(model, path)
    got = run_in_fresh_process(
        f"""
        import json, sys, torch
        import aitune.torch as ait

        model = ait.load(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval(),
                         {str(path)!r})
        with torch.no_grad():
            model(torch.randn(3, 8))
        picked = [b.name for _, b in model.tuned_graphs]
        print(json.dumps([picked, sorted(m for m in ("onnx", "onnxscript", "ml_dtypes") if m in sys.modules)]))
        """
    )
    assert got == [["onnxruntime"], []]
