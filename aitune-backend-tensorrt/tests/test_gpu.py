"""Real TensorRT builds on a CUDA GPU: build, infer vs eager, save/load, profiles, precision, CUDA graphs.

Every test here is ``gpu``-marked and skips visibly on a machine without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aitune.backend import BuildContext, LoadContext
from aitune.graph import Sample, infer_graph
from aitune.testing import assert_matches_eager
from aitune.validation import validate

pytestmark = pytest.mark.gpu


class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3, padding=1)
        )
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x)
        return self.head(features.mean(dim=(2, 3))), features


def _setup(tmp_path: Path, batches=(2, 4, 4, 8), module=None):
    module = (module or SmallCNN()).eval().cuda()
    g = torch.Generator().manual_seed(1)
    samples = [Sample((torch.randn(b, 3, 16, 16, generator=g).cuda(),)) for b in batches]
    with torch.no_grad():
        outputs = [module(*s.args) for s in samples]
    graph = infer_graph(samples, ["x"], outputs=outputs)
    (tmp_path / "work").mkdir(exist_ok=True)
    context = BuildContext(graph, samples, torch.device("cuda"), tmp_path / "work", tmp_path / "cache")
    return module, samples, graph, context


def _build(config, tmp_path: Path, **kw):
    from aitune_backend_tensorrt import TensorRTBackend

    module, samples, graph, context = _setup(tmp_path, **kw)
    backend = TensorRTBackend(config)
    with torch.no_grad():
        backend.build(module, context)
    return backend, module, samples, graph


def test_build_matches_eager_and_keeps_the_output_structure(tmp_path):
    from aitune_backend_tensorrt import TensorRTBackendConfig

    backend, module, samples, graph = _build(TensorRTBackendConfig(), tmp_path)
    with torch.no_grad():
        report = validate(backend, module, samples, graph)
        out = backend.infer(*samples[0].args)
    assert report.passed, report.reason
    assert isinstance(out, tuple) and out[0].shape == (2, 10) and out[1].shape == (2, 16, 16, 16)
    assert backend.build_info["profiles"] == 1 and backend.build_info["dynamic"]


def test_infer_runs_on_the_callers_stream(tmp_path):
    from aitune_backend_tensorrt import TensorRTBackendConfig

    backend, module, samples, _ = _build(TensorRTBackendConfig(tf32=False), tmp_path)
    stream = torch.cuda.Stream()
    x = samples[3].args[0]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        got = backend.infer(x)[0]
    stream.synchronize()
    torch.testing.assert_close(got, module(x)[0], atol=1e-4, rtol=1e-3)


def test_save_load_round_trip_without_rebuild(tmp_path):
    from aitune_backend_tensorrt import TensorRTBackend, TensorRTBackendConfig

    backend, module, samples, graph = _build(TensorRTBackendConfig(), tmp_path)
    payload = tmp_path / "payload"
    payload.mkdir()
    metadata = backend.save(payload)
    assert metadata["compute_capability"] == list(torch.cuda.get_device_capability())
    assert metadata["gpu_name"] == torch.cuda.get_device_name()
    assert [i["name"] for i in metadata["inputs"]] == ["x"]
    loaded = TensorRTBackend(backend.config)
    loaded.load(module, payload, LoadContext(graph, torch.device("cuda"), metadata, tmp_path / "cache"))
    with torch.no_grad():
        for s in samples:
            for a, b in zip(backend.infer(*s.args), loaded.infer(*s.args)):
                assert_matches_eager(a, b)


def test_timing_cache_is_saved_and_reused(tmp_path):
    from aitune_backend_tensorrt import TensorRTBackendConfig

    first, *_ = _build(TensorRTBackendConfig(), tmp_path)
    assert first.build_info["timing_cache"] == "new"
    assert list((tmp_path / "cache" / "tensorrt").glob("timing-cache-*.bin"))
    second, *_ = _build(TensorRTBackendConfig(), tmp_path)
    assert second.build_info["timing_cache"] == "reused"


def test_several_profiles_pick_the_one_containing_the_call(tmp_path):
    from aitune_backend_tensorrt import TensorRTBackendConfig, TensorRTProfile

    small = TensorRTProfile(shapes={"x": ((1, 3, 16, 16), (2, 3, 16, 16), (4, 3, 16, 16))})
    large = TensorRTProfile(shapes={"x": ((5, 3, 16, 16), (8, 3, 16, 16), (8, 3, 16, 16))})
    backend, module, samples, graph = _build(TensorRTBackendConfig(profiles=[small, large]), tmp_path)
    assert backend.build_info["profiles"] == 2
    runner = backend._runner
    with torch.no_grad():
        report = validate(backend, module, samples, graph)
    assert report.passed, report.reason
    assert runner._selected[((8, 3, 16, 16),)] == 1 and runner._selected[((2, 3, 16, 16),)] == 0


def test_cuda_graphs_stay_within_their_bytes_and_cycling_shapes_capture_nothing_more(tmp_path):
    from aitune_backend_tensorrt import TensorRTBackendConfig
    from aitune_backend_tensorrt.graphs import GRAPH_FLOOR_BYTES

    config = TensorRTBackendConfig(use_cuda_graphs=True, cuda_graph_memory=2 * GRAPH_FLOOR_BYTES, tf32=False)
    backend, module, samples, graph = _build(config, tmp_path, batches=(2, 3, 4, 8))
    runner = backend._runner
    # the build warmed up four shapes: the first two fit the budget (tiny graphs count 1 MiB each)
    assert runner.captures == 2 and runner.ungraphed_calls == 2
    assert runner.cached_graphs == [((2, 3, 16, 16),), ((3, 3, 16, 16),)]
    x = torch.randn(3, 3, 16, 16, device="cuda")
    with torch.no_grad():
        a = backend.infer(x)[0]
        b = backend.infer(x * 2)[0]  # same shape: replay with new data, and `a` is not overwritten
        torch.testing.assert_close(a, module(x)[0], atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(b, module(x * 2)[0], atol=1e-4, rtol=1e-3)
    captures = runner.captures
    g = torch.Generator(device="cuda").manual_seed(5)
    with torch.no_grad():
        for _ in range(5):  # four shapes in a cycle, two graphs' room: replays and plain enqueues only
            for batch in (2, 3, 4, 8):
                _assert_close_to_eager(backend, module, torch.randn(batch, 3, 16, 16, device="cuda", generator=g))
    assert runner.captures == captures and runner.recaptures == 0
    with torch.no_grad():
        for _ in range(20):  # one shape far hotter than the coldest graph takes its place, once
            _assert_close_to_eager(backend, module, torch.randn(5, 3, 16, 16, device="cuda", generator=g))
    assert runner.captures == captures + 1 and ((5, 3, 16, 16),) in runner.cached_graphs
    assert len(runner.cached_graphs) == 2 and runner.kept_graph_bytes <= config.cuda_graph_memory
    with torch.no_grad():
        report = validate(backend, module, samples, graph)
    assert report.passed, report.reason


class WideCNN(torch.nn.Module):
    """Large activations (64 channels at full resolution), small outputs: a new context's own
    activation memory would show in the device's free memory."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(64, 64, 3, padding=1),
            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_graph_contexts_share_the_engines_one_block_of_activation_memory(tmp_path):
    from aitune_backend_tensorrt import TensorRTBackend, TensorRTBackendConfig

    module = WideCNN().eval().cuda()
    samples = [Sample((torch.randn(b, 3, 256, 256, device="cuda"),)) for b in (2, 8)]
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    (tmp_path / "work").mkdir()
    backend = TensorRTBackend(TensorRTBackendConfig(use_cuda_graphs=True, tf32=False))
    with torch.no_grad():
        backend.build(module, BuildContext(graph, samples, torch.device("cuda"), tmp_path / "work", tmp_path / "c"))
    runner = backend._runner
    engine = runner.engine
    needed = getattr(engine, "device_memory_size_v2", None) or engine.device_memory_size
    assert runner.device_memory_bytes >= needed > 64 * 2**20, "the model was meant to need real activation memory"
    assert runner.captures == 2
    x = torch.randn(6, 3, 256, 256, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the capture empties torch's cache: blocks freed then must not hide a new allocation
    free_before = torch.cuda.mem_get_info()[0]
    with torch.no_grad():
        got = backend.infer(x)  # a third shape: a new context and a graph, on the shared memory
    torch.cuda.synchronize()
    dropped = free_before - torch.cuda.mem_get_info()[0]
    assert runner.captures == 3
    assert dropped < needed / 2, f"the new context took {dropped} bytes, the engine's activation memory is {needed}"
    with torch.no_grad():
        assert_matches_eager(got, module(x))


def _assert_close_to_eager(backend, module, x) -> None:
    for a, b in zip(backend.infer(x), module(x)):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-4 + 1e-3 * float(b.abs().max())


@pytest.mark.parametrize("own_profiles", [False, True])
def test_a_graph_replayed_after_another_shape_ran_is_still_right(tmp_path, own_profiles):
    """A-B-A with new data each call: each captured shape has an execution context of its own, on a
    profile of its own or sharing the default one, so nothing is recaptured either way."""
    from aitune_backend_tensorrt import TensorRTBackendConfig, TensorRTProfile

    profiles = [TensorRTProfile(shapes={"x": ((b, 3, 16, 16),) * 3}) for b in (2, 4, 8)] if own_profiles else []
    config = TensorRTBackendConfig(use_cuda_graphs=True, tf32=False, profiles=profiles)
    backend, module, _, _ = _build(config, tmp_path, batches=(2, 4, 4, 8))
    runner = backend._runner
    captured = runner.captures
    g = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        for batch in (4, 8, 4, 2, 8, 4):
            _assert_close_to_eager(backend, module, torch.randn(batch, 3, 16, 16, device="cuda", generator=g))
    assert runner.recaptures == 0
    assert runner.captures == captured, "each shape was captured at build; the alternation only replays"


def test_autocast_fp16_engine_is_within_fp16_tolerance(tmp_path):
    pytest.importorskip("modelopt.onnx.autocast")
    from aitune_backend_tensorrt import ONNXAutoCastConfig, TensorRTBackendConfig

    backend, module, samples, graph = _build(
        TensorRTBackendConfig(quantization_config=ONNXAutoCastConfig(low_precision_type="fp16")), tmp_path
    )
    with torch.no_grad():
        report = validate(backend, module, samples, graph)
    assert report.passed, report.reason
    assert "fp16" in backend.build_info["precision"]
    layers = backend.build_info["layer_precisions"]  # the engine inspector's own count, checked by the build
    assert isinstance(layers, dict) and layers.get("fp16", 0) > 0, layers


def test_an_fp16_engine_with_two_profiles_passes_the_check_in_each(tmp_path):
    pytest.importorskip("modelopt.onnx.autocast")
    from aitune_backend_tensorrt import ONNXAutoCastConfig, TensorRTBackendConfig, TensorRTProfile

    profiles = [TensorRTProfile(shapes={"x": ((b, 3, 16, 16),) * 3}) for b in (2, 8)]
    config = TensorRTBackendConfig(quantization_config=ONNXAutoCastConfig(low_precision_type="fp16"), profiles=profiles)
    backend, module, samples, graph = _build(config, tmp_path, batches=(2, 8))
    assert backend.build_info["layer_precisions"].get("fp16", 0) > 0
    with torch.no_grad():
        assert validate(backend, module, samples, graph).passed


def test_an_fp32_engine_reports_no_fp16_layer(tmp_path):
    from aitune_backend_tensorrt import TensorRTBackendConfig

    backend, *_ = _build(TensorRTBackendConfig(tf32=False), tmp_path)
    layers = backend.build_info["layer_precisions"]
    assert isinstance(layers, dict) and layers.get("fp32", 0) > 0 and "fp16" not in layers, layers


def test_int8_quantized_engine_calibrates_on_all_samples(tmp_path):
    pytest.importorskip("modelopt.onnx.quantization")
    from aitune_backend_tensorrt import ModelOptQuantizationConfig, TensorRTBackendConfig

    backend, module, samples, graph = _build(
        TensorRTBackendConfig(quantization_config=ModelOptQuantizationConfig(mode="int8")), tmp_path
    )
    assert backend.build_info["calibration_samples"] >= len(samples)
    with torch.no_grad():
        report = validate(backend, module, samples, graph)
    assert report.passed, report.reason


def test_isolated_build_runs_the_engine_build_in_a_worker(tmp_path):
    """export here, build_exported in ``python -m aitune.builds.worker`` from the ONNX files alone, load here."""
    from aitune.executor import run_worker
    from aitune_backend_tensorrt import TensorRTBackend, TensorRTBackendConfig

    module, samples, graph, context = _setup(tmp_path)
    backend = TensorRTBackend(TensorRTBackendConfig())
    folder = tmp_path / "isolated"
    (folder / "exported").mkdir(parents=True)
    with torch.no_grad():
        notes = backend.export(module, context, folder / "exported")
    metadata = run_worker(backend, notes, context, folder)
    assert [p.name for p in (folder / "payload").iterdir()] == ["engine.plan"]
    assert metadata["compute_capability"] == list(torch.cuda.get_device_capability())
    assert metadata["build"]["dynamic"] and metadata["build"]["layers"] > 0
    backend.load(module, folder / "payload", LoadContext(graph, torch.device("cuda"), metadata, tmp_path / "cache"))
    with torch.no_grad():
        report = validate(backend, module, samples, graph)
    assert report.passed, report.reason


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_an_engine_on_the_second_gpu_runs_there_whatever_device_is_current(tmp_path):
    from aitune_backend_tensorrt import TensorRTBackend, TensorRTBackendConfig

    second = torch.device("cuda", 1)
    module = SmallCNN().eval().to(second)
    samples = [Sample((torch.randn(b, 3, 16, 16, device=second),)) for b in (2, 4)]
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    (tmp_path / "work").mkdir()
    backend = TensorRTBackend(TensorRTBackendConfig(tf32=False))
    torch.cuda.set_device(0)
    with torch.no_grad():
        backend.build(module, BuildContext(graph, samples, second, tmp_path / "work", tmp_path / "cache"))
        assert torch.cuda.current_device() == 0
        got = backend.infer(samples[1].args[0])[0]
        want = module(samples[1].args[0])[0]
    torch.cuda.synchronize(second)
    assert got.device == second
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)
