"""ONNXRuntimeBackend on CPU: accuracy against eager, nested and dynamic inputs, the artifact, providers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from aitune import tree
from aitune.backend import BuildContext, LoadContext
from aitune.converter import unstructure
from aitune.errors import BackendUnavailableError, ConfigError, NotApplicableError, SerializationError
from aitune.graph import GraphSpec, Sample, infer_graph
from aitune.onnx_export import ONNXExportConfig
from aitune.testing import assert_matches_eager, config_from_json, config_to_json
from aitune.testing.conformance import run_in_fresh_process
from aitune.validation import validate
from aitune_backend_onnxruntime import plugin
from aitune_backend_onnxruntime.backend import ONNXRuntimeBackend
from aitune_backend_onnxruntime.config import ONNXExecutionProvider, ONNXRuntimeBackendConfig
from aitune_backend_onnxruntime.runner import provider_chain, resolve_shape, tensorrt_profile

CPU = torch.device("cpu")
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


class MLP(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


class CNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.Conv2d(8, 8, 3, stride=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(8, 5),
        )  # fmt: skip

    def forward(self, x):
        return self.net(x)


class Nested(torch.nn.Module):
    """Dict and tuple inputs (one of them integer), a dict output holding a tuple and a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, batch, scale):
        h = self.proj(self.embed(batch["ids"])) * batch["mask"].unsqueeze(-1)
        return {"hidden": h * scale[0], "pooled": (h.mean(1), "cls")}


def _samples(make, sizes):
    g = torch.Generator().manual_seed(0)
    return [Sample((make(g, *size),)) for size in sizes]


CASES = {
    "mlp": (MLP, lambda g, b: torch.randn(b, 16, generator=g), [(2,), (6,)], (4,)),
    "cnn": (CNN, lambda g, b: torch.randn(b, 3, 12, 12, generator=g), [(2,), (5,)], (3,)),
    "transformer": (
        lambda: torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
        lambda g, b, s: torch.randn(b, s, 16, generator=g),
        [(2, 5), (4, 9)],
        (3, 7),
    ),
}


def _build(module, samples, arg_names, tmp_path, config=None):
    torch.manual_seed(0)
    with torch.no_grad():
        graph = infer_graph(samples, arg_names, outputs=[module(*s.args, **s.kwargs) for s in samples])
    backend = ONNXRuntimeBackend(config)
    context = BuildContext(graph, samples, CPU, tmp_path / "work", tmp_path / "cache")
    context.workdir.mkdir(parents=True)
    context.cache_dir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        backend.build(module, context)
    return backend, graph


@pytest.mark.parametrize("case", list(CASES))
def test_models_match_eager_on_samples_extremes_and_an_unseen_size(tmp_path, case):
    make_module, make_input, sizes, unseen = CASES[case]
    torch.manual_seed(0)
    module = make_module().eval()
    samples = _samples(make_input, sizes)
    backend, graph = _build(module, samples, ["src" if case == "transformer" else "x"], tmp_path)

    with torch.no_grad():
        report = validate(backend, module, samples, graph)
        assert report.passed, report.reason
        x = make_input(torch.Generator().manual_seed(5), *unseen)
        torch.testing.assert_close(backend.infer(x), module(x), rtol=1e-3, atol=1e-4)
    assert backend.build_info["session_providers"][0] == "CPUExecutionProvider"
    assert backend.build_info["exporter"] == "dynamo"


def test_nested_dict_and_tuple_inputs_and_outputs_with_dynamic_batch_and_length(tmp_path):
    torch.manual_seed(0)
    module = Nested().eval()
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            (
                {"ids": torch.randint(0, 20, (b, s), generator=g), "mask": torch.rand(b, s, generator=g)},
                (torch.tensor(2.0),),
            )
        )
        for b, s in [(2, 4), (3, 8)]
    ]
    backend, graph = _build(module, samples, ["batch", "scale"], tmp_path)
    assert set(graph.dims) == {"batch", "d0"}
    with torch.no_grad():
        assert validate(backend, module, samples, graph).passed
        call = ({"ids": torch.randint(0, 20, (1, 6)), "mask": torch.rand(1, 6)}, (torch.tensor(0.5),))
        got, want = backend.infer(*call), module(*call)
    assert got["pooled"][1] == "cls"
    assert tree.flatten(got)[1] == tree.flatten(want)[1]
    for g_, w in zip(tree.flatten(got)[0], tree.flatten(want)[0]):
        torch.testing.assert_close(g_, w, rtol=1e-4, atol=1e-5)
    # the same call on host arrays (a server's): flat inputs in the graph's order, flat outputs in the
    # output structure's; a read-only array (a request's own bytes) and a transposed view are taken too
    assert backend.runs_host_arrays()
    call = ({"ids": torch.randint(0, 20, (2, 6)), "mask": torch.rand(2, 6)}, (torch.tensor(0.5),))
    with torch.no_grad():
        flat = tree.flatten(backend.infer(*call))[0]
    arrays = [t.numpy().copy() for t in tree.flatten(call)[0]]
    arrays[0].flags.writeable = False
    arrays[1] = np.asfortranarray(arrays[1])
    assert not arrays[1].flags.c_contiguous
    on_host = backend.infer_host(arrays)
    assert all(isinstance(a, np.ndarray) for a in on_host) and len(on_host) == len(flat)
    for h, g_ in zip(on_host, flat):
        np.testing.assert_array_equal(h, g_.numpy())


def test_torchscript_exporter_is_used_when_chosen(tmp_path):
    module = MLP().eval()
    samples = _samples(CASES["mlp"][1], [(2,), (3,)])
    config = ONNXRuntimeBackendConfig(export=ONNXExportConfig(exporter="torchscript"))
    backend, graph = _build(module, samples, ["x"], tmp_path, config)
    assert backend.build_info["exporter"] == "torchscript"
    with torch.no_grad():
        assert validate(backend, module, samples, graph).passed


@needs_no_cuda
@pytest.mark.parametrize("provider", [ONNXExecutionProvider.CUDA, ONNXExecutionProvider.TENSORRT])
def test_asking_for_a_gpu_provider_here_fails_before_any_build(tmp_path, provider, monkeypatch):
    module = MLP().eval()
    samples = _samples(CASES["mlp"][1], [(2,)])
    graph = infer_graph(samples, ["x"])
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(execution_provider=provider))
    reason = backend.unsupported_reason(graph, CPU)
    assert reason and provider.ort_name in reason and "no CUDA device is visible" in reason
    assert "ONNXExecutionProvider.CPU" in reason, "the message says what to do"

    def no_export(*args, **kwargs):
        raise AssertionError("exported although the provider cannot run")

    monkeypatch.setattr("aitune_backend_onnxruntime.export.export_onnx", no_export)
    context = BuildContext(graph, samples, CPU, tmp_path, tmp_path)
    with pytest.raises(BackendUnavailableError, match=provider.ort_name):
        backend.build(module, context)


@needs_no_cuda
def test_backend_listing_says_why_cuda_and_tensorrt_are_unavailable():
    from aitune.plugins import get_manager

    status = get_manager().registry.status("onnxruntime")
    assert status.devices["cpu"] is None
    assert "CUDA and TensorRT execution providers unavailable: no CUDA device is visible" in status.devices["cuda"]


def test_probe_explains_a_missing_or_cpu_only_runtime(monkeypatch):
    monkeypatch.setattr(plugin, "installed_runtime", lambda: None)
    assert "pip install 'aitune-backend-onnxruntime[cpu]'" in plugin.provider_unavailable("cpu")
    monkeypatch.setattr(plugin, "installed_runtime", lambda: ("onnxruntime", "1.32.0"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert plugin.provider_unavailable("cpu") is None
    assert "CPU-only build" in plugin.provider_unavailable("cuda")
    monkeypatch.setattr(plugin, "installed_runtime", lambda: ("onnxruntime-gpu", "1.32.0"))
    monkeypatch.setattr(plugin, "tensorrt_library", lambda: ("libnvinfer.so.10", None))
    assert plugin.provider_unavailable("tensorrt") is None
    monkeypatch.setattr(plugin, "installed_runtime", lambda: ("onnxruntime-gpu", "1.17.3"))
    assert "GPU providers need >= 1.18" in plugin.provider_unavailable("cuda")
    monkeypatch.setattr(plugin, "installed_runtime", lambda: ("onnxruntime", "1.12.0"))
    assert ">= 1.17 is required" in plugin.provider_unavailable("cpu")


def test_bfloat16_inputs_are_refused_up_front():
    samples = [Sample((torch.randn(2, 4, dtype=torch.bfloat16),))]
    reason = ONNXRuntimeBackend().unsupported_reason(infer_graph(samples, ["x"]), CPU)
    assert reason and "bfloat16" in reason


def test_save_then_load_in_a_fresh_process_gives_the_same_outputs_without_exporting(tmp_path):
    module = MLP().eval()
    samples = _samples(CASES["mlp"][1], [(2,), (6,)])
    backend, graph = _build(module, samples, ["x"], tmp_path)
    payload = tmp_path / "payload"
    payload.mkdir()
    metadata = backend.save(payload)
    assert sorted(p.name for p in payload.iterdir()) == sorted(metadata["files"])
    x = torch.randn(5, 16)
    with torch.no_grad():
        want = backend.infer(x)
    (tmp_path / "state.json").write_text(
        json.dumps(
            {
                "graph": unstructure(graph),
                "metadata": metadata,
                "x": x.tolist(),
                "config": config_to_json(backend.config),
            }
        )
    )
    got = run_in_fresh_process(
        f"""
        import json, torch
        import aitune.onnx_export, aitune_backend_onnxruntime.backend as b, aitune_backend_onnxruntime.export as e
        from aitune.backend import LoadContext
        from aitune.converter import structure
        from aitune.testing import config_from_json
        from aitune.graph import GraphSpec

        def refuse(*a, **k):
            raise AssertionError("load exported the model again")

        e.export_onnx = aitune.onnx_export.export_onnx = refuse
        state = json.load(open({str(tmp_path / "state.json")!r}))
        graph = structure(state["graph"], GraphSpec)
        backend = b.ONNXRuntimeBackend(config_from_json(state["config"]))
        ctx = LoadContext(graph, torch.device("cpu"), state["metadata"], {str(tmp_path / "cache")!r})
        backend.load(torch.nn.Identity(), {str(payload)!r}, ctx)
        print(json.dumps(backend.infer(torch.tensor(state["x"])).tolist()))
        """
    )
    assert_matches_eager(torch.tensor(got), want)


def test_optimized_model_payload_carries_the_external_data_it_points_at(tmp_path):
    module = MLP(width=128).eval()
    samples = _samples(lambda g, b: torch.randn(b, 128, generator=g), [(2,), (4,)])
    config = ONNXRuntimeBackendConfig(save_optimized_model=True, export=ONNXExportConfig(external_data=True))
    backend, graph = _build(module, samples, ["x"], tmp_path, config)
    payload = tmp_path / "payload"
    payload.mkdir()
    metadata = backend.save(payload)
    assert metadata["optimized_model"] == "model.optimized.onnx"
    assert set(metadata["files"]) == {"model.onnx", "model.onnx.data", "model.optimized.onnx"}

    loaded = ONNXRuntimeBackend(config)
    loaded.load(module, payload, LoadContext(graph, CPU, metadata, tmp_path / "cache"))
    assert loaded.build_info["loaded_optimized_model"] is True
    x = torch.randn(3, 128)
    with torch.no_grad():
        assert_matches_eager(loaded.infer(x), backend.infer(x))

    (payload / "model.onnx.data").unlink()
    with pytest.raises(SerializationError, match=r"model\.onnx\.data"):
        ONNXRuntimeBackend(config).load(module, payload, LoadContext(graph, CPU, metadata, tmp_path / "cache"))


def test_config_round_trips_through_json_and_bad_values_are_refused():
    config = ONNXRuntimeBackendConfig(
        execution_provider=ONNXExecutionProvider.TENSORRT,
        graph_optimization_level="extended",
        intra_op_num_threads=2,
        provider_options={"trt_fp16_enable": True},
        export=ONNXExportConfig(exporter="torchscript", opset=17),
    )
    data = json.loads(json.dumps(config_to_json(config)))
    assert data["execution_provider"] == "tensorrt" and data["provider_options"] == {"trt_fp16_enable": "True"}
    assert config_from_json(data) == config
    with pytest.raises(ConfigError, match="graph_optimization_level"):
        ONNXRuntimeBackendConfig(graph_optimization_level="max")
    with pytest.raises(ConfigError, match="execution_provider"):
        ONNXRuntimeBackendConfig(execution_provider="rocm")
    with pytest.raises(ConfigError, match="intra_op_num_threads"):
        ONNXRuntimeBackendConfig(intra_op_num_threads=-1)
    with pytest.raises(ConfigError, match=r"\$\.export"):
        config_from_json({"backend": "onnxruntime", "export": {"exporter": "tf"}})


def test_public_names_reach_aitune_torch_backend():
    from aitune.torch.backend import ONNXExecutionProvider as exported
    from aitune.torch.backend import ONNXRuntimeBackend as backend_class

    assert exported is ONNXExecutionProvider and backend_class is ONNXRuntimeBackend


def _dynamic_graph() -> GraphSpec:
    samples = [Sample((torch.zeros(b, s, 8), {"mask": torch.zeros(b, s)})) for b, s in [(1, 4), (8, 16)]]
    return infer_graph(samples, ["x", "extra"])


def test_tensorrt_provider_gets_the_graph_shape_profile_and_an_engine_cache(tmp_path):
    graph = _dynamic_graph()
    chain = provider_chain(
        ONNXExecutionProvider.TENSORRT, 1, graph, ["x", "extra_mask"], {"trt_fp16_enable": "True"}, tmp_path
    )
    assert [name for name, _ in chain] == ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    trt = chain[0][1]
    assert trt["trt_profile_min_shapes"] == "x:1x4x8,extra_mask:1x4"
    assert trt["trt_profile_max_shapes"] == "x:8x16x8,extra_mask:8x16"
    assert trt["device_id"] == "1" and trt["trt_fp16_enable"] == "True"
    assert trt["trt_engine_cache_path"].startswith(str(tmp_path))
    assert tensorrt_profile(infer_graph([Sample((torch.zeros(2, 3),))], ["x"]), ["x"]) == {}
    assert provider_chain(ONNXExecutionProvider.CUDA, 0, graph, [], {}, tmp_path)[0] == (
        "CUDAExecutionProvider",
        {"device_id": "0", "use_tf32": "0"},
    ), "CUDA computes fp32 as fp32, so the fp32 bound holds"
    assert (
        provider_chain(ONNXExecutionProvider.CUDA, 0, graph, [], {"use_tf32": "1"}, tmp_path)[0][1]["use_tf32"] == "1"
    )


def test_each_payload_gets_tensorrt_engines_of_its_own(tmp_path):
    """The provider keys its engine cache by names, not weights: a fine-tune and its base must not share one."""
    from aitune_backend_onnxruntime.runner import model_digest

    graph = _dynamic_graph()
    base, tuned = tmp_path / "base.onnx", tmp_path / "tuned.onnx"
    base.write_bytes(b"graph with weights A")
    tuned.write_bytes(b"graph with weights B")
    prefixes = [
        provider_chain(ONNXExecutionProvider.TENSORRT, 0, graph, ["x"], {}, tmp_path, model_digest=model_digest(m, []))[
            0
        ][1]["trt_engine_cache_prefix"]
        for m in (base, tuned, base)
    ]
    assert prefixes[0] != prefixes[1] and prefixes[0] == prefixes[2]


def test_output_shapes_follow_from_named_input_dims():
    assert resolve_shape(["batch", "d0", 4], {"batch": 3, "d0": 7}) == (3, 7, 4)
    assert resolve_shape(["batch", "s12"], {"batch": 3}) is None, "unknown symbols: ONNX Runtime allocates"
    assert resolve_shape(None, {}) is None


# -- on a GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("provider", [None, ONNXExecutionProvider.TENSORRT])
def test_gpu_providers_keep_tensors_on_the_device(tmp_path, provider):
    cuda = torch.device("cuda")
    module = MLP().eval().to(cuda)
    samples = [Sample((torch.randn(b, 16, device=cuda),)) for b in (2, 6)]
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(execution_provider=provider))
    reason = backend.unsupported_reason(graph, cuda)
    if reason:
        pytest.skip(reason)
    context = BuildContext(graph, samples, cuda, tmp_path, tmp_path)
    with torch.no_grad():
        backend.build(module, context)
        assert validate(backend, module, samples, graph).passed
        out = backend.infer(torch.randn(4, 16, device=cuda))
    assert out.device.type == "cuda"
    assert backend.build_info["io_binding"] is True
    assert backend.build_info["session_providers"][0] == backend.provider_for(cuda).ort_name


def test_the_tensorrt_provider_is_offered_only_when_its_library_loads(monkeypatch, tmp_path):
    plugin.tensorrt_library.cache_clear()
    monkeypatch.setattr(plugin, "installed_runtime", lambda: ("onnxruntime-gpu", "1.32.0"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(plugin, "nvinfer_candidates", lambda: [])
    monkeypatch.setattr(plugin, "_loads", lambda library: f"{library}: cannot open shared object file")
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # the hint names TensorRT for torch's CUDA
    try:
        reason = plugin.provider_unavailable("tensorrt")
        assert f"{plugin.NVINFER} does not load here" in reason and "tensorrt-cu12-libs" in reason
        assert plugin.provider_unavailable("cuda") is None, "the CUDA provider does not need TensorRT"
        with pytest.raises(OSError, match="does not load"):
            plugin.preload_tensorrt()

        plugin.tensorrt_library.cache_clear()
        wheel = tmp_path / plugin.NVINFER
        wheel.write_bytes(b"")
        monkeypatch.setattr(plugin, "nvinfer_candidates", lambda: [wheel])
        monkeypatch.setattr(plugin, "_loads", lambda library: None if library == str(wheel) else "no")
        assert plugin.provider_unavailable("tensorrt") is None
        assert plugin.tensorrt_library() == (str(wheel), None), "the wheel's copy is the one preloaded"
    finally:
        plugin.tensorrt_library.cache_clear()


def test_pip_tensorrt_and_the_loader_path_are_searched(monkeypatch, tmp_path):
    import sys

    libs = tmp_path / "tensorrt_libs"
    libs.mkdir()
    (libs / "__init__.py").write_text("")
    (libs / plugin.NVINFER).write_bytes(b"")
    other = tmp_path / "lib"
    other.mkdir()
    (other / plugin.NVINFER).write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PATH" if sys.platform == "win32" else "LD_LIBRARY_PATH", f"{tmp_path / 'empty'}:{other}")
    monkeypatch.delitem(sys.modules, "tensorrt_libs", raising=False)
    assert plugin.nvinfer_candidates() == [libs / plugin.NVINFER, other / plugin.NVINFER]
    assert "tensorrt_libs" not in sys.modules, "located, never imported"


def test_gpu_providers_run_on_the_stream_aitune_gives_them(tmp_path):
    graph = _dynamic_graph()
    for provider in (ONNXExecutionProvider.CUDA, ONNXExecutionProvider.TENSORRT):
        options = dict(provider_chain(provider, 0, graph, ["x", "extra_mask"], {}, tmp_path, stream=1234)[0][1])
        assert options["user_compute_stream"] == "1234"
    assert provider_chain(ONNXExecutionProvider.CPU, 0, graph, [], {}, tmp_path, stream=1234) == [
        ("CPUExecutionProvider", {})
    ]


class _Flatten(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).reshape(-1)  # its length, batch * 16, is named after no input dim


@pytest.mark.gpu
def test_outputs_of_unnamed_shape_are_preallocated_after_the_first_call_of_a_shape(tmp_path):
    cuda = torch.device("cuda")
    module = _Flatten().eval()
    samples = [Sample((torch.randn(b, 16, device=cuda),)) for b in (2, 6)]
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(execution_provider=ONNXExecutionProvider.CUDA))
    reason = backend.unsupported_reason(graph, cuda)
    if reason:
        pytest.skip(reason)
    backend.build(module, BuildContext(graph, samples, cuda, tmp_path, tmp_path))
    assert backend.runner.out_shapes[((6, 16),)] == [(96,)], "warm-up learnt the output shape ONNX Runtime gave"
    x = torch.randn(6, 16, device=cuda)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # any caller stream: ONNX Runtime's stream is ordered against it
        out = backend.infer(x)
        want = module(x)
    side.synchronize()
    assert out.shape == (96,) and float((out - want).abs().max()) < 1e-5


def test_a_gpu_build_for_another_cuda_major_than_torch_is_named_in_the_listing(monkeypatch, tmp_path):
    """PyPI's onnxruntime-gpu and torch may be built for different CUDA majors: the providers would
    fail to load their CUDA libraries and fall back, so the probe says which build to install."""
    assert (
        plugin.cuda_major_of("package_name = 'onnxruntime-gpu'\n__version__ = '1.24.1'\ncuda_version = '13.0'\n") == 13
    )
    assert plugin.cuda_major_of("package_name = 'onnxruntime'\n__version__ = '1.24.1'\n") is None  # the CPU build
    assert plugin.cuda_major_of("cuda_version = (") is None
    assert plugin.cuda_mismatch("onnxruntime-gpu", "1.24.1", 12, "12.8") is None
    assert plugin.cuda_mismatch("onnxruntime-gpu", "1.24.1", None, "13.0") is None
    reason = plugin.cuda_mismatch("onnxruntime-gpu", "1.24.1", 13, "12.8")
    assert "built for CUDA 13 and torch for CUDA 12" in reason and "build for CUDA 12" in reason
    monkeypatch.setattr(plugin, "installed_runtime", lambda: ("onnxruntime-gpu", "1.24.1"))
    monkeypatch.setattr(plugin, "runtime_cuda_major", lambda: 13)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert "built for CUDA 13 and torch for CUDA 12" in plugin.provider_unavailable("cuda")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(plugin, "tensorrt_library", lambda: ("libnvinfer.so.10", None))
    assert plugin.provider_unavailable("cuda") is None and plugin.provider_unavailable("tensorrt") is None


def test_the_cuda_major_is_read_from_the_installed_build_info_without_importing_it(monkeypatch, tmp_path):
    import importlib.machinery
    import importlib.util
    import sys

    package = tmp_path / "onnxruntime"
    (package / "capi").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / "capi" / "build_and_package_info.py").write_text("cuda_version = '12.4'\n")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: importlib.machinery.PathFinder.find_spec(name, [str(tmp_path)])
    )
    assert plugin.runtime_cuda_major() == 12
    assert "onnxruntime" not in sys.modules or not str(getattr(sys.modules["onnxruntime"], "__file__", "")).startswith(
        str(tmp_path)
    )


def test_the_gpu_extra_floor_is_the_one_the_probe_enforces():
    import importlib.metadata

    from packaging.requirements import Requirement

    gpu = [
        Requirement(r)
        for r in importlib.metadata.requires("aitune-backend-onnxruntime") or []
        if r.startswith("onnxruntime-gpu") and Requirement(r).marker.evaluate({"extra": "gpu"})
    ]
    floor = ".".join(map(str, plugin.MIN_GPU_VERSION))
    assert len(gpu) == 1 and gpu[0].specifier.contains(f"{floor}.0") and not gpu[0].specifier.contains("1.17.3")


def test_a_payload_naming_a_model_outside_it_is_refused(tmp_path):
    """Metadata and graphs come from a file: what ONNX Runtime opens must be one of the payload's files."""
    module = MLP(width=128).eval()
    samples = _samples(lambda g, b: torch.randn(b, 128, generator=g), [(2,), (4,)])
    config = ONNXRuntimeBackendConfig(export=ONNXExportConfig(external_data=True))
    backend, graph = _build(module, samples, ["x"], tmp_path, config)
    payload = tmp_path / "payload"
    payload.mkdir()
    metadata = backend.save(payload)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    other, _ = _build(MLP(width=128).eval(), samples, ["x"], tmp_path / "other", config)
    other.save(elsewhere)

    def load(meta):
        ONNXRuntimeBackend(config).load(module, payload, LoadContext(graph, CPU, meta, tmp_path / "cache"))

    for name in (str(elsewhere / "model.onnx"), "../elsewhere/model.onnx"):
        with pytest.raises(SerializationError, match="not one of its files"):
            load({**metadata, "model": name})
    with pytest.raises(SerializationError, match="not a plain path"):
        load({**metadata, "files": [*metadata["files"], "/etc/hostname"]})

    # the graph itself names its external data: pointed outside the payload, it is refused too
    import onnx

    proto = onnx.load(str(payload / "model.onnx"), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = str(elsewhere / "model.onnx.data")
    onnx.save(proto, str(payload / "model.onnx"))
    with pytest.raises(SerializationError, match="keeps tensor data in"):
        load(metadata)


def test_provider_options_from_a_file_are_allow_listed():
    safe = {"backend": "onnxruntime", "provider_options": {"trt_fp16_enable": "True", "device_id": "0"}}
    assert config_from_json(safe).provider_options == safe["provider_options"]
    from aitune.plugins import get_manager

    registry = get_manager().registry
    assert registry.config_from_json(safe, from_file=True).provider_options == safe["provider_options"]
    for key in ("trt_extra_plugin_lib_paths", "trt_engine_cache_path", "trt_dump_ep_context_model"):
        data = {"backend": "onnxruntime", "provider_options": {key: "/tmp/x"}}
        assert config_from_json(data).provider_options == {key: "/tmp/x"}, "your own code may set it"
        with pytest.raises(ConfigError, match=key):
            registry.config_from_json(data, from_file=True)


def test_the_session_runs_under_the_torch_thread_budget(tmp_path):
    """One thread budget for eager and every candidate: ONNX Runtime's pool follows torch's count."""
    from aitune.backend import machine_cores

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        module = MLP().eval()
        backend, _ = _build(module, _samples(CASES["mlp"][1], [(2,), (6,)]), ["x"], tmp_path)
        assert backend.build_info["threads"] == 1
        assert backend.runner.inference.get_session_options().intra_op_num_threads == 1
        pinned, _ = _build(
            module,
            _samples(CASES["mlp"][1], [(2,)]),
            ["x"],
            tmp_path / "p",
            ONNXRuntimeBackendConfig(intra_op_num_threads=2),
        )
        assert pinned.runner.inference.get_session_options().intra_op_num_threads == min(2, machine_cores()), (
            "a config's own count wins, up to the cores"
        )
    finally:
        torch.set_num_threads(before)


def test_thread_counts_from_a_file_are_capped_at_the_machines_cores(tmp_path):
    """``intra_op_num_threads=2000`` in an artifact's config started 2000 threads."""
    from aitune.backend import machine_cores

    data = {"backend": "onnxruntime", "intra_op_num_threads": 2000, "inter_op_num_threads": 500}
    config = config_from_json(data, from_file=True)
    module = MLP().eval()
    backend, _ = _build(module, _samples(CASES["mlp"][1], [(2,)]), ["x"], tmp_path, config)
    options = backend.runner.inference.get_session_options()
    assert options.intra_op_num_threads == machine_cores() and options.inter_op_num_threads == machine_cores()
    assert backend.build_info["threads"] == machine_cores()


def test_both_exports_are_default_candidates_named_by_their_variant():
    configs = ONNXRuntimeBackend.default_configs()
    assert [c.export.exporter for c in configs] == ["dynamo", "torchscript", "dynamo"]
    assert not configs[0].export.fallback_to_torchscript, "the dynamo candidate never duplicates the other"
    assert [ONNXRuntimeBackend(c).variant() for c in configs] == [None, "torchscript export", "eager attention"]
    quantized = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(quantization="dynamic_int8"))
    assert quantized.variant() == "dynamic int8"


@pytest.mark.parametrize("quantization", ["dynamic_int8", "static_int8"])
def test_int8_graphs_pass_under_their_declared_bound_and_round_trip(tmp_path, quantization):
    from aitune.validation import validate

    module = MLP(width=64).eval()
    samples = _samples(lambda g, b: torch.randn(b, 64, generator=g), [(2,), (8,), (4,)])
    config = ONNXRuntimeBackendConfig(quantization=quantization)
    backend, graph = _build(module, samples, ["x"], tmp_path, config)
    assert backend.build_info["quantize_s"] >= 0
    report = validate(backend, module, samples, graph)
    assert report.passed, report.reason
    assert report.outputs[0].max_rel_error > 0, "an int8 graph is not the fp32 one"
    payload = tmp_path / "payload"
    payload.mkdir()
    metadata = backend.save(payload)
    assert metadata["model"] == "model.int8.onnx" and metadata["model"] in metadata["files"]
    loaded = ONNXRuntimeBackend(config)
    loaded.load(module, payload, LoadContext(graph, CPU, metadata, tmp_path / "cache"))
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert_matches_eager(loaded.infer(x), backend.infer(x))  # the same int8 graph, loaded


def test_the_attention_variant_exports_a_transformers_model_with_eager_attention_and_restores_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50
    )
    model = transformers.BertModel(config).eval()
    before = model.config._attn_implementation
    g = torch.Generator().manual_seed(0)
    samples = [Sample((), {"input_ids": torch.randint(0, 50, (b, 8), generator=g)}) for b in (1, 2)]
    with torch.no_grad():
        graph = infer_graph(samples, ["input_ids"], outputs=[model(**s.kwargs) for s in samples])
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(attention="eager"))
    context = BuildContext(graph, samples, CPU, tmp_path / "work", tmp_path / "cache")
    context.workdir.mkdir(parents=True)
    with torch.no_grad():
        backend.build(model, context)
    assert model.config._attn_implementation == before, "the model's own attention is restored"
    assert validate(backend, model, samples, graph).passed
    with pytest.raises(NotApplicableError, match="transformers models only"):  # listed as not applicable
        _build(
            MLP().eval(),
            _samples(CASES["mlp"][1], [(2,)]),
            ["x"],
            tmp_path / "mlp",
            ONNXRuntimeBackendConfig(attention="eager"),
        )


def test_tf32_turned_on_by_the_user_gets_tf32s_bound():
    from aitune_backend_onnxruntime.config import TF32_TOLERANCE

    assert ONNXRuntimeBackend().tolerance(torch.float32) is None, "fp32 as fp32: the dtype's own bound"
    tf32 = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(provider_options={"use_tf32": "1"}))
    assert tf32.tolerance(torch.float32) == TF32_TOLERANCE and tf32.tolerance(torch.float16) is None


def test_variants_of_one_graph_share_one_export_and_nothing_else_does(tmp_path, monkeypatch):
    """The int8 variant runs the plain variant's exported graph: it copies those files instead of
    exporting again. Another export config, another call's samples or new weights export afresh."""
    import aitune_backend_onnxruntime.export as ort_export

    exports = []
    real = ort_export.export_onnx
    monkeypatch.setattr(ort_export, "export_onnx", lambda *a, **k: exports.append(1) or real(*a, **k))
    module = MLP().eval()
    samples = _samples(CASES["mlp"][1], [(2,), (6,)])
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])

    def build(config, samples=samples):
        backend = ONNXRuntimeBackend(config)
        context = BuildContext(graph, samples, CPU, tmp_path / "work", tmp_path / "cache")
        context.workdir.mkdir(parents=True, exist_ok=True)
        context.cache_dir.mkdir(parents=True, exist_ok=True)
        with torch.no_grad():
            backend.build(module, context)
        return backend

    plain = build(ONNXRuntimeBackendConfig())
    int8 = build(ONNXRuntimeBackendConfig(quantization="dynamic_int8"))
    assert len(exports) == 1 and int8.build_info["export_shared"] and not plain.build_info["export_shared"]
    assert int8.build_info["export_s"] == 0.0
    with torch.no_grad():
        assert validate(plain, module, samples, graph).passed
        x = samples[1].args[0]
        assert torch.allclose(int8.infer(x), module(x), atol=0.1), "the int8 variant runs the shared graph"
    build(ONNXRuntimeBackendConfig(export=ONNXExportConfig(exporter="torchscript")))
    assert len(exports) == 2, "another export config exports"
    build(ONNXRuntimeBackendConfig(), samples=[Sample((s.args[0].clone(),)) for s in samples])
    assert len(exports) == 3, "other recorded samples export"
    with torch.no_grad():
        module.net[0].weight.mul_(2)
    build(ONNXRuntimeBackendConfig())
    assert len(exports) == 4, "changed weights export"


def test_the_eager_attention_variant_of_a_model_already_eager_shares_the_plain_export(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    import aitune_backend_onnxruntime.export as ort_export

    exports = []
    real = ort_export.export_onnx
    monkeypatch.setattr(ort_export, "export_onnx", lambda *a, **k: exports.append(1) or real(*a, **k))
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        max_position_embeddings=32, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    module = transformers.BertModel(config).eval()
    g = torch.Generator().manual_seed(0)
    samples = [Sample((torch.randint(0, 100, (b, s), generator=g),)) for b, s in ((1, 6), (2, 9))]
    with torch.no_grad():
        graph = infer_graph(samples, ["input_ids"], outputs=[module(*s.args) for s in samples])
    built, alive = [], []  # a tune keeps its candidates alive; the export's files live in the first one's folder
    for attention in (None, "eager", "sdpa"):
        backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(attention=attention))
        context = BuildContext(graph, samples, CPU, tmp_path / "work", tmp_path / "cache")
        context.workdir.mkdir(parents=True, exist_ok=True)
        context.cache_dir.mkdir(parents=True, exist_ok=True)
        with torch.no_grad():
            backend.build(module, context)
        built.append(backend.build_info["export_shared"])
        alive.append(backend)
    assert built == [False, True, False] and len(exports) == 2, "eager is this model's own attention; sdpa is not"


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_a_graph_pinned_to_one_batch_size_is_exported_static(tmp_path, exporter):
    """What ``MaxThroughputStrategy(static_shapes=True)`` relies on (``builds_static``): a batch range of
    one size gives a model whose inputs have that size, which answers as eager at it."""
    import attrs
    import onnx

    from aitune.graph import BATCH, DimRange

    assert ONNXRuntimeBackend.builds_static
    module = MLP().eval()
    config = ONNXRuntimeBackendConfig(export=ONNXExportConfig(exporter=exporter))
    samples = _samples(lambda g, b: torch.randn(b, 16, generator=g), [(2,), (6,)])
    dynamic, graph = _build(module, samples, ["x"], tmp_path / "dynamic", config)
    pinned = attrs.evolve(graph, dims={**graph.dims, BATCH: DimRange(6, 6, 6)})
    backend = ONNXRuntimeBackend(config)
    context = BuildContext(pinned, samples[1:], CPU, tmp_path / "work", tmp_path / "cache")
    context.workdir.mkdir(parents=True)
    context.cache_dir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        backend.build(module, context)
        x = torch.randn(6, 16)
        assert_matches_eager(backend.infer(x), module(x))

    def input_dims(built: ONNXRuntimeBackend, folder: str) -> list[int | str]:
        payload = tmp_path / folder
        payload.mkdir()
        built.save(payload)
        proto = onnx.load(str(payload / "model.onnx"), load_external_data=False)
        [dims] = [[d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in proto.graph.input]
        return dims

    assert input_dims(backend, "static") == [6, 16]
    assert isinstance(input_dims(dynamic, "dynamic-payload")[0], str), "the dynamic build's batch axis is symbolic"


class Residual(torch.nn.Module):
    """Linear, the residual and a LayerNorm: what ONNX Runtime's SkipLayerNormFusion matches in BERT."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(self.lin(x) + x)


def _op_types(path) -> set[str]:
    import onnx

    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


def test_the_cpu_session_runs_without_the_skip_layer_norm_fusion_and_a_saved_graph_says_so(tmp_path):
    """The fusion's fp32 CPU kernel is slower than the Add and LayerNormalization it replaces."""
    import onnxruntime as ort

    module = Residual().eval()
    samples = _samples(lambda g, b: torch.randn(b, 8, 32, generator=g), [(2,), (4,)])
    config = ONNXRuntimeBackendConfig(save_optimized_model=True, export=ONNXExportConfig(fallback_to_torchscript=False))
    backend, graph = _build(module, samples, ["x"], tmp_path, config)
    assert backend.build_info["disabled_optimizers"] == ["SkipLayerNormFusion"]
    plain = tmp_path / "plain.onnx"  # the same graph in a session of ONNX Runtime's defaults fuses it
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(plain)
    ort.InferenceSession(
        str(backend.exported.folder / backend.exported.model), options, providers=["CPUExecutionProvider"]
    )
    assert "SkipLayerNormalization" in _op_types(plain)
    assert "SkipLayerNormalization" not in _op_types(backend.exported.folder / "model.optimized.onnx")

    payload = tmp_path / "payload"
    payload.mkdir()
    metadata = backend.save(payload)
    assert metadata["optimized_without"] == ["SkipLayerNormFusion"]
    x = torch.randn(3, 8, 32)
    for meta, used in ((metadata, True), ({**metadata, "optimized_without": None}, False)):
        # an optimized graph saved before (with the fusion in it) is left for the export, optimized anew
        loaded = ONNXRuntimeBackend(config)
        loaded.load(module, payload, LoadContext(graph, CPU, meta, tmp_path / "cache"))
        assert loaded.build_info["loaded_optimized_model"] is used
        assert loaded.build_info.get("disabled_optimizers") == (None if used else ["SkipLayerNormFusion"])
        with torch.no_grad():
            assert_matches_eager(loaded.infer(x), module(x))
