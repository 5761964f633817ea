"""ModelOpt on the exported ONNX model, on CPU: AutoCast to fp16 and int8 quantization,
both fed the recorded samples (all of them)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from aitune_backend_tensorrt.config import ModelOptQuantizationConfig, ONNXAutoCastConfig
from aitune_backend_tensorrt.precision import autocast, calibration_feeds, quantize

pytest.importorskip("modelopt.onnx.autocast", reason="ModelOpt's ONNX tools are in this member's [test] extra")


def _run(path, feed):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)[0]


def test_calibration_feeds_are_every_sample_by_onnx_name(mlp_export):
    exported, samples, graph, _ = mlp_export
    feeds = calibration_feeds(graph, samples, exported.input_names)
    assert [list(f) for f in feeds] == [["x"]] * len(samples)
    for feed, sample in zip(feeds, samples):
        np.testing.assert_array_equal(feed["x"], sample.args[0].numpy())


def test_autocast_fp16_keeps_io_types_and_matches_eager(mlp_export, tmp_path):
    exported, samples, graph, _ = mlp_export
    feeds = calibration_feeds(graph, samples, exported.input_names)
    path = autocast(exported.path, ONNXAutoCastConfig(low_precision_type="fp16"), feeds, tmp_path)

    model = onnx.load(str(path))
    fp16 = onnx.TensorProto.FLOAT16
    assert any(init.data_type == fp16 for init in model.graph.initializer), "no weight was cast to fp16"
    assert [v.type.tensor_type.elem_type for v in model.graph.input] == [onnx.TensorProto.FLOAT]
    assert [v.type.tensor_type.elem_type for v in model.graph.output] == [onnx.TensorProto.FLOAT]
    assert len(list((tmp_path / "autocast-calibration").glob("*.npz"))) == len(samples)

    from aitune.testing import TinyMLP

    x = samples[1].args[0]
    want = TinyMLP().eval()(x).detach().numpy()
    got = _run(path, {"x": x.numpy()})
    assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


def test_autocast_op_exclusion_keeps_those_ops_in_fp32(mlp_export, tmp_path):
    exported, samples, graph, _ = mlp_export
    feeds = calibration_feeds(graph, samples, exported.input_names)
    ops = {n.op_type for n in onnx.load(str(exported.path)).graph.node}
    matmul = "Gemm" if "Gemm" in ops else "MatMul"
    path = autocast(exported.path, ONNXAutoCastConfig(op_types_to_exclude=[matmul]), feeds, tmp_path)
    model = onnx.load(str(path))
    assert not any(i.data_type == onnx.TensorProto.FLOAT16 for i in model.graph.initializer)


def test_int8_quantization_adds_qdq_calibrated_on_every_sample(mlp_export, tmp_path):
    exported, samples, graph, _ = mlp_export
    feeds = calibration_feeds(graph, samples, exported.input_names)
    config = ModelOptQuantizationConfig(mode="int8", calibration="max", calibration_providers=("cpu",))
    path, served = quantize(exported.path, config, feeds, tmp_path)

    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    assert served == len(samples), f"calibration read {served} distinct of {len(samples)} recorded samples"

    x = samples[0].args[0]
    from aitune.testing import TinyMLP

    want = TinyMLP().eval()(x).detach().numpy()
    got = _run(path, {"x": x.numpy()}).astype(np.float32)
    cosine = float((got * want).sum() / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert cosine > 0.99


def test_bfloat16_inputs_cannot_be_fed_to_numpy_calibration(mlp_export):
    from aitune.errors import BuildError
    from aitune.graph import Sample

    _, _, graph, _ = mlp_export
    with pytest.raises(BuildError, match="bfloat16"):
        calibration_feeds(graph, [Sample((torch.zeros(2, 16, dtype=torch.bfloat16),))], ["x"])


def test_calibration_runs_on_the_gpu_being_built_for():
    from aitune_backend_tensorrt.precision import providers_for, reference_providers

    assert providers_for(("cuda", "cpu"), 1) == ["cuda:1", "cpu"], "a bare cuda is the build's device"
    assert providers_for(("cuda:0", "cpu"), 1) == ["cuda:0", "cpu"], "a device the user named stays"
    assert ModelOptQuantizationConfig().calibration_providers == ("cuda", "cpu")
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        assert reference_providers(1) == ["cpu"], "no CUDA in this ONNX Runtime: AutoCast's reference on the CPU"
    else:
        assert reference_providers(1) == ["cuda:1", "cpu"]
    assert reference_providers(None) == ["cpu"]
