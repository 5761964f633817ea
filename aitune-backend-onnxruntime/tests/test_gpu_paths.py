"""GPU sessions of the onnxruntime backend, checked on CPU up to the GPU call: where ONNX Runtime
placed the nodes (read from the formats it writes), the order of the stream calls around an IO
bound run, and the TensorRT engine cache of a refit. The ``gpu`` tests run the same on a GPU."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import ClassVar

import numpy as np
import onnxruntime as ort
import pytest
import torch

from aitune.backend import BuildContext
from aitune.errors import BuildError
from aitune.graph import Sample, infer_graph
from aitune.validation import validate
from aitune_backend_onnxruntime import placement
from aitune_backend_onnxruntime.backend import ONNXRuntimeBackend
from aitune_backend_onnxruntime.config import ONNXExecutionProvider, ONNXRuntimeBackendConfig
from aitune_backend_onnxruntime.export import ExportedModel, write_refit_copy
from aitune_backend_onnxruntime.runner import ORTRunner, config_entries, model_digest, provider_chain


class ConvHead(torch.nn.Module):
    """A convolution and a Linear behind a reshape by a run-time size: shape arithmetic the CUDA
    provider leaves to the CPU, compute it must keep."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        y = torch.relu(self.conv(x)).mean((2, 3))
        return self.head(y.view(x.shape[0], -1))


@pytest.fixture(scope="module")
def conv_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("placement")
    path = folder / "model.onnx"
    torch.manual_seed(0)
    torch.onnx.export(
        ConvHead().eval(), (torch.randn(2, 3, 8, 8),), str(path), dynamo=False,
        input_names=["x"], dynamic_axes={"x": {0: "batch"}},
    )  # fmt: skip
    return path


def _options(**config):
    options = ort.SessionOptions()
    for key, value in config.items():
        options.add_session_config_entry(key, value)
    return options


def test_the_assignment_onnx_runtime_records_names_compute_on_the_cpu(conv_model):
    """A CPU session places everything on the CPU provider: read from the real assignment, the
    convolution and the Gemm are found, the Reshape and ReduceMean are not compute."""
    if not placement.records_assignment(ort.InferenceSession):
        pytest.skip("this onnxruntime predates get_provider_graph_assignment_info (1.24)")
    options = _options(**{placement.RECORD_KEY: "1"})
    session = ort.InferenceSession(str(conv_model), options, providers=["CPUExecutionProvider"])
    found = placement.cpu_compute_from_assignment(session.get_provider_graph_assignment_info())
    assert sorted(op for _, op in found) == ["Conv", "Gemm"]
    assert "Conv" in placement.fallback_error(found, "CUDAExecutionProvider", "test")


def test_a_profile_onnx_runtime_writes_names_compute_on_the_cpu_and_is_removed(conv_model, tmp_path):
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "placement")
    session = ort.InferenceSession(str(conv_model), options, providers=["CPUExecutionProvider"])
    session.run(None, {"x": np.zeros((2, 3, 8, 8), np.float32)})
    path = session.end_profiling()
    events = json.loads(Path(path).read_text())
    assert any(e.get("cat") == "Node" and e["args"].get("op_name") == "Reshape" for e in events)
    found = placement.read_profile(path)
    assert sorted(op for _, op in found) == ["Conv", "Gemm"], "the fused NCHWc Conv keeps op_name Conv"
    assert not list(tmp_path.iterdir()), "the profile is removed once read"


def _subgraph(ep, *nodes):
    items = [types.SimpleNamespace(name=name, op_type=op, domain="") for name, op in nodes]
    return types.SimpleNamespace(ep_name=ep, get_nodes=lambda: items)


def test_shape_arithmetic_on_the_cpu_is_allowed_and_compute_is_not():
    shapes = _subgraph("CPUExecutionProvider", ("/Shape", "Shape"), ("/Gather", "Gather"), ("/Concat", "Concat"))
    gpu = _subgraph("CUDAExecutionProvider", ("/conv/Conv", "Conv"), ("/head/MatMul", "MatMul"))
    assert placement.cpu_compute_from_assignment([shapes, gpu]) == []
    assert placement.fallback_error([], "CUDAExecutionProvider", "x") is None
    attention = _subgraph("CPUExecutionProvider", ("/attn", "MultiHeadAttention"), ("/q", "MatMulNBits"))
    found = placement.cpu_compute_from_assignment([shapes, gpu, attention])
    assert found == [("/attn", "MultiHeadAttention"), ("/q", "MatMulNBits")]
    profile = [
        {"cat": "Session", "name": "model_run", "args": {}},
        {"cat": "Node", "name": "/q_fence_before", "args": {"op_name": "FusedMatMul"}},  # no provider: skipped
        {"cat": "Node", "name": "/q_kernel_time", "args": {"op_name": "FusedMatMul", "provider": "CPUExecutionProvider"}},
        {"cat": "Node", "name": "/q_kernel_time", "args": {"op_name": "FusedMatMul", "provider": "CPUExecutionProvider"}},
        {"cat": "Node", "name": "/c_kernel_time", "args": {"op_name": "FusedConv", "provider": "CUDAExecutionProvider"}},
        {"cat": "Node", "name": "TRTKernel_graph_0_kernel_time", "args": {"op_name": "TRTKernel_graph_0",
                                                                           "provider": "TensorrtExecutionProvider"}},
        "not an event",
    ]  # fmt: skip
    assert placement.cpu_compute_from_profile(profile) == [("/q", "FusedMatMul")]
    assert placement.cpu_compute_from_profile({"not": "a list"}) == []


@pytest.mark.parametrize("op", ["Einsum", "LSTM", "GRU"])
def test_einsum_and_recurrent_layers_on_the_cpu_are_a_fallback(op):
    """An LSTM or GRU, or the Einsum of attention scores, left to the CPU is the model's arithmetic."""
    shapes = _subgraph("CPUExecutionProvider", ("/Shape", "Shape"), ("/layer", op))
    assert placement.cpu_compute_from_assignment([shapes]) == [("/layer", op)]
    error = placement.fallback_error([("/layer", op)], "CUDAExecutionProvider", "by the session's graph assignment")
    assert error is not None and f"/layer ({op})" in error


def test_gpu_sessions_record_placement_and_never_disable_the_cpu_fallback(tmp_path):
    """``session.disable_cpu_ep_fallback`` with the CPU provider listed is refused by ONNX Runtime
    ("Conflicting session configuration"), and without it any shape arithmetic on the CPU is."""
    for provider in (ONNXExecutionProvider.CUDA, ONNXExecutionProvider.TENSORRT):
        assert config_entries(provider, True) == {placement.RECORD_KEY: "1"}
        assert config_entries(provider, False) == {}
        chain = provider_chain(provider, 0, infer_graph([Sample((torch.zeros(2, 3),))], ["x"]), ["x"], {}, tmp_path)
        assert chain[-1][0] == "CPUExecutionProvider", "the CPU provider takes what the GPU provider leaves"
    assert config_entries(ONNXExecutionProvider.CPU, True) == {}


class _FakeSession:
    """ONNX Runtime's session as a GPU build would create it, with the placement a test gives it."""

    subgraphs: ClassVar[list] = []
    opened: ClassVar[list] = []

    def __init__(self, path, options, providers):
        self.providers = [name for name, _ in providers]
        self.options = options
        _FakeSession.opened.append(self)

    def get_providers(self):
        return self.providers

    def get_outputs(self):
        return []

    def get_provider_graph_assignment_info(self):
        if self.options.get_session_config_entry(placement.RECORD_KEY) != "1":
            raise RuntimeError(f"Session configuration entry '{placement.RECORD_KEY}' must be set")
        return _FakeSession.subgraphs


@pytest.fixture
def gpu_runtime(monkeypatch):
    """A CUDA provider that ONNX Runtime reports available, a stream torch hands out, fake sessions."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(ort, "InferenceSession", _FakeSession)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: types.SimpleNamespace(cuda_stream=7))
    _FakeSession.opened = []
    return _FakeSession


def _runner(tmp_path):
    graph = infer_graph([Sample((torch.zeros(2, 3, 8, 8),))], ["x"])
    cuda = torch.device("cuda", 0)
    return ORTRunner(ONNXRuntimeBackendConfig(), graph, cuda, ONNXExecutionProvider.CUDA, tmp_path, ("x",), ("y",), {})


def test_a_session_that_puts_compute_on_the_cpu_fails_with_the_nodes_named(gpu_runtime, conv_model, tmp_path):
    cpu = _subgraph("CPUExecutionProvider", ("/Shape", "Shape"), ("/head/Gemm", "Gemm"))
    gpu_runtime.subgraphs = [cpu, _subgraph("CUDAExecutionProvider", ("/conv/Conv", "Conv"))]
    with pytest.raises(BuildError, match=r"1 compute node\(s\) on the CPU.*/head/Gemm \(Gemm\)"):
        _runner(tmp_path).open(conv_model, [conv_model.name])
    options = gpu_runtime.opened[-1].options
    assert options.get_session_config_entry(placement.RECORD_KEY) == "1"
    assert not options.enable_profiling, "the assignment is recorded: no profiled run needed"

    gpu_runtime.subgraphs = [_subgraph("CPUExecutionProvider", ("/Shape", "Shape"))]
    runner = _runner(tmp_path)
    runner.open(conv_model, [conv_model.name])
    assert runner.inference is gpu_runtime.opened[-1] and not runner.profiling
    assert "graph assignment" in runner.notes["placement"]


def test_before_1_24_the_first_run_at_build_is_profiled_and_read(gpu_runtime, monkeypatch, conv_model, tmp_path):
    """Without the assignment API the session profiles until the first run's profile is read; a
    real CPU profile (Conv and Gemm on the CPU provider) then fails the build."""
    monkeypatch.delattr(_FakeSession, "get_provider_graph_assignment_info")
    runner = _runner(tmp_path)
    runner.open(conv_model, [conv_model.name], profile_to=tmp_path / "placement")
    options = gpu_runtime.opened[-1].options
    assert options.enable_profiling and runner.profiling
    with pytest.raises(RuntimeError, match="does not have configuration"):
        options.get_session_config_entry(placement.RECORD_KEY)

    real = ort.SessionOptions()
    real.enable_profiling = True
    real.profile_file_prefix = str(tmp_path / "real")
    session = ort.capi.onnxruntime_inference_collection.InferenceSession(
        str(conv_model), real, providers=["CPUExecutionProvider"]
    )
    session.run(None, {"x": np.zeros((2, 3, 8, 8), np.float32)})
    written = session.end_profiling()
    runner.inference.end_profiling = lambda: written
    with pytest.raises(BuildError, match=r"compute node\(s\) on the CPU .*profile of the first run.*Conv"):
        runner.check_profiled_placement()
    assert not runner.profiling

    runner.open(conv_model, [conv_model.name])  # a load or refit: no profile to read, nothing profiled
    assert not gpu_runtime.opened[-1].options.enable_profiling and not runner.profiling


# -- IO binding: the input copies land before ONNX Runtime's stream may read them ------------------


class _Log(list):
    def stream(self, name):
        log = self

        class Stream:
            def wait_stream(self, other):
                log.append(f"{name} waits for {other.name}")

            def synchronize(self):
                log.append(f"{name} synchronize")

        s = Stream()
        s.name = name
        return s


class _HostInput:
    """A non-contiguous host tensor as the caller passes it: copied to the device, then bound."""

    def __init__(self, log, name, shape):
        self.log, self.name, self.shape, self.dtype = log, name, shape, torch.float32

    def detach(self):
        return self

    def to(self, device):
        self.log.append(f"copy {self.name} on the caller's stream")
        return self

    def contiguous(self):
        return self

    def record_stream(self, stream):
        self.log.append(f"{self.name} kept for {stream.name}")

    def data_ptr(self):
        return 1


def test_input_copies_are_queued_before_onnx_runtimes_stream_waits(monkeypatch):
    log = _Log()
    caller = log.stream("caller")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: caller)
    binding = types.SimpleNamespace(
        bind_input=lambda name, *a: log.append(f"bind {name}"),
        bind_output=lambda name, *a: log.append(f"bind output {name}"),
    )
    graph = infer_graph([Sample((torch.zeros(2, 4), torch.zeros(2, 4)))], ["a", "b"])
    host = torch.device("cpu")  # the outputs are allocated here; only the stream calls are CUDA's
    runner = ORTRunner(
        ONNXRuntimeBackendConfig(), graph, host, ONNXExecutionProvider.CUDA, Path("."), ("a", "b"), ("y",), {}
    )
    runner.inference = types.SimpleNamespace(
        io_binding=lambda: binding, run_with_iobinding=lambda b, o: log.append("ONNX Runtime runs")
    )
    runner.bound, runner.outputs, runner.stream = True, [(torch.float32, [2, 4])], log.stream("ort")
    runner.run([_HostInput(log, "a", (2, 4)), _HostInput(log, "b", (2, 4))])
    wait = log.index("ort waits for caller")
    assert log.index("copy a on the caller's stream") < wait and log.index("copy b on the caller's stream") < wait
    assert wait < log.index("ONNX Runtime runs") < log.index("caller waits for ort")
    assert log.index("a kept for ort") < log.index("ONNX Runtime runs")


# -- TensorRT engine cache: one per weights, refit included --------------------------------------


def test_equal_graphs_with_other_weights_get_other_engine_cache_prefixes(tmp_path):
    graph = infer_graph([Sample((torch.zeros(2, 8),))], ["x"])
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        path = tmp_path / f"m{seed}.onnx"
        torch.onnx.export(torch.nn.Linear(8, 4).eval(), (torch.zeros(2, 8),), str(path), dynamo=False)
        paths.append(path)

    def prefix(model):
        chain = provider_chain(
            ONNXExecutionProvider.TENSORRT,
            0,
            graph,
            ["x"],
            {},
            tmp_path,
            model_digest=model_digest(model, [model.name]),
        )
        return chain[0][1]["trt_engine_cache_prefix"]

    def refitted(value, folder):
        exported = ExportedModel(tmp_path, [paths[0].name], ("x",), ("y",), None, {}, model=paths[0].name)
        return write_refit_copy(exported, {"weight": np.full((4, 8), value, np.float32)}, tmp_path / folder)[0]

    assert prefix(paths[0]) != prefix(paths[1]), "two payloads: same graph, other weights"
    refit = prefix(refitted(1.0, "a"))
    assert refit != prefix(paths[0]), "a refit opens a copy with the new weights written in: a new engine"
    assert refit == prefix(refitted(1.0, "b")), "the same weights reuse it"
    assert refit != prefix(refitted(2.0, "c"))


def test_the_tensorrt_provider_computes_fp32_in_tf32_and_declares_it():
    """TensorRT's TF32 builder flag is on by default and the provider does not clear it."""
    from aitune_backend_onnxruntime.config import TF32_TOLERANCE

    trt = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(execution_provider=ONNXExecutionProvider.TENSORRT))
    assert trt.tolerance(torch.float32) == TF32_TOLERANCE and trt.computes_tf32()
    assert not ONNXRuntimeBackend().computes_tf32(), "CUDA runs fp32 as fp32 (use_tf32 off)"
    on = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(provider_options={"use_tf32": "1"}))
    assert on.computes_tf32()


# -- on a GPU ---------------------------------------------------------------------------------


def _gpu_build(tmp_path, module, samples, provider):
    cuda = torch.device("cuda")
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(execution_provider=provider))
    reason = backend.unsupported_reason(graph, cuda)
    if reason:
        pytest.skip(reason)
    with torch.no_grad():
        backend.build(module, BuildContext(graph, samples, cuda, tmp_path / "work", tmp_path / "cache"))
    return backend, graph


@pytest.mark.gpu
@pytest.mark.parametrize("provider", [ONNXExecutionProvider.CUDA, ONNXExecutionProvider.TENSORRT])
def test_a_dynamic_reshape_export_builds_on_the_gpu_and_matches_eager(tmp_path, provider):
    cuda = torch.device("cuda")
    module = ConvHead().eval().to(cuda)
    samples = [Sample((torch.randn(b, 3, 8, 8, device=cuda),)) for b in (2, 6)]
    backend, graph = _gpu_build(tmp_path, module, samples, provider)
    assert backend.build_info["session_providers"][0] == provider.ort_name
    assert backend.build_info["placement"].startswith("no compute node on the CPU")
    with torch.no_grad():
        assert validate(backend, module, samples, graph).passed


@pytest.mark.gpu
def test_non_contiguous_and_host_inputs_are_read_after_their_copy(tmp_path):
    cuda = torch.device("cuda")
    module = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).eval().to(cuda)
    samples = [Sample((torch.randn(b, 256, device=cuda),)) for b in (4, 64)]
    backend, _ = _gpu_build(tmp_path, module, samples, ONNXExecutionProvider.CUDA)
    with torch.no_grad():
        for _ in range(20):
            wide = torch.randn(256, 64, device=cuda)
            torch.cuda._sleep(1_000_000)  # the caller's stream is busy: a read before the copy shows
            x = wide.t()  # non-contiguous: copied on the caller's stream
            assert float((backend.infer(x) - module(x)).abs().max()) < 1e-3
            host = torch.randn(64, 256)
            assert float((backend.infer(host) - module(host.to(cuda))).abs().max()) < 1e-3


@pytest.mark.gpu
def test_a_refit_under_the_tensorrt_provider_serves_the_new_weights(tmp_path):
    cuda = torch.device("cuda")
    module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval().to(cuda)
    samples = [Sample((torch.randn(b, 16, device=cuda),)) for b in (2, 6)]
    backend, _ = _gpu_build(tmp_path, module, samples, ONNXExecutionProvider.TENSORRT)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5)
        assert backend.refit(dict(module.state_dict()))
        x = torch.randn(4, 16, device=cuda)
        assert float((backend.infer(x) - module(x)).abs().max()) < 1e-2, "the engine of the old weights was reused"


# -- TensorRT 11 (aitune-backend-tensorrt's extras) and the provider's TensorRT 10 ------------------


def test_tensorrt_11_beside_the_tensorrt_provider_is_refused_with_the_fix(monkeypatch):
    from aitune_backend_onnxruntime import plugin

    conflict = plugin.tensorrt_conflict(("tensorrt-cu12", "11.4.0.106"), "12")
    assert "TensorRT 11" in conflict and "built against TensorRT 10 (libnvinfer.so.10)" in conflict
    assert "pip install 'tensorrt-cu12>=10,<11' 'tensorrt-cu12-libs>=10,<11'" in conflict
    assert plugin.tensorrt_conflict(("tensorrt-cu13-libs", "10.13.3.9"), "13") is None
    assert plugin.tensorrt_conflict(None, "13") is None
    assert "Torch-TensorRT 2.13 cannot then share" in conflict
    with_torchtrt = plugin.tensorrt_conflict(("tensorrt-cu13", "11.0.0.11"), "13", "2.13.0")
    assert "Torch-TensorRT 2.13.0 requires TensorRT 11.0, so pinning TensorRT 10 would break it" in with_torchtrt
    assert "pip install" not in with_torchtrt and "use the CUDA provider" in with_torchtrt
    older = plugin.tensorrt_conflict(("tensorrt-cu13", "11.0.0.11"), "13", "2.12.1")
    assert "pip install 'tensorrt-cu13>=10,<11'" in older, "Torch-TensorRT 2.12 is on TensorRT 10.16: the pin fixes it"

    monkeypatch.setattr(plugin, "installed_torch_tensorrt", lambda: None)
    monkeypatch.setattr(plugin, "installed_runtime", lambda: ("onnxruntime-gpu", "1.32.0"))
    monkeypatch.setattr(plugin, "runtime_cuda_major", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(plugin, "tensorrt_library", lambda: ("libnvinfer.so.10", None))
    monkeypatch.setattr(plugin, "installed_tensorrt", lambda: ("tensorrt-cu13", "11.4.0.106"))
    reason = plugin.provider_unavailable("tensorrt")
    assert reason and "tensorrt-cu13>=10,<11" in reason, "refused even where a stray libnvinfer.so.10 loads"
    assert plugin.provider_unavailable("cuda") is None, "the CUDA provider needs no TensorRT"
    monkeypatch.setattr(plugin, "installed_tensorrt", lambda: ("tensorrt-cu13", "10.16.0.72"))
    assert plugin.provider_unavailable("tensorrt") is None


def test_the_backend_description_names_the_tensorrt_major_of_the_provider():
    from aitune.plugins import get_manager

    spec = get_manager().registry.spec("onnxruntime")
    assert "the TensorRT provider needs TensorRT 10" in spec.description
