"""The JIT backend counts the TensorRT engines Torch-TensorRT returns: none is a failed build, not eager.

Torch-TensorRT's ``compile_module`` hands the graph back unchanged, with a warning only, when no
node converts or fewer than ``min_block_size`` do; on CPU a stand-in for its torch.compile backend
returns what it would (the graph unchanged, or with ``_run_on_acc`` engines beside
``_run_on_gpu`` PyTorch parts), one call per graph Dynamo hands over.
"""

from __future__ import annotations

import pytest
import torch

from aitune.errors import BuildError
from aitune.graph import Sample, infer_graph
from aitune_backend_torchtrt.backend import TorchTensorRTJitBackend, compile_counting, tensorrt_engines
from aitune_backend_torchtrt.config import TorchTensorRTConfig, TorchTensorRTJitBackendConfig


class TorchTensorRTModule(torch.nn.Module):
    """Named as Torch-TensorRT's engine module is; never run here."""


class TwoGraphs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.a(x))
        torch._dynamo.graph_break()  # two graphs: Torch-TensorRT's backend is called twice
        return self.b(x)


def _setup():
    module = TwoGraphs().eval()
    samples = [Sample((torch.randn(b, 8),)) for b in (2, 5)]
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    return module, graph, samples


def test_a_graph_handed_back_unconverted_fails_the_build():
    torch._dynamo.reset()
    module, graph, samples = _setup()
    seen = []

    def unconverted(gm, example_inputs, **kwargs):  # compile_module below min_block_size: gm as it was
        seen.append(kwargs)
        return gm

    with pytest.raises(BuildError, match=r"no part of the \d+ graph\(s\).*min_block_size=5"):
        compile_counting(module, graph, samples, unconverted, {"min_block_size": 5})
    assert seen and all(k == {"options": {"min_block_size": 5}} for k in seen), "Torch-TensorRT gets the options"
    torch._dynamo.reset()


def test_engines_are_summed_across_graph_breaks():
    torch._dynamo.reset()
    module, graph, samples = _setup()
    calls = []

    def converted(gm, example_inputs, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the first graph converts; the second stays in PyTorch
            gm.add_submodule("_run_on_acc_0", TorchTensorRTModule())
        else:
            gm.add_submodule("_run_on_gpu_0", torch.nn.Identity())
        return gm

    compiled, counter = compile_counting(module, graph, samples, converted, {"min_block_size": 1})
    assert counter.graphs >= 2, "one per graph break (and per recompile of the warm-up's shapes)"
    assert (counter.engines, counter.torch_parts) == (1, counter.graphs - 1)
    with torch.no_grad():
        x = torch.randn(3, 8)
        assert torch.allclose(compiled(x), module(x))
    torch._dynamo.reset()


def test_engines_are_counted_by_name_or_class_and_wrappers_count_none():
    holder = torch.nn.Module()
    holder.add_module("_run_on_acc_0", torch.nn.Identity())
    holder.add_module("engine", TorchTensorRTModule())
    holder.add_module("_run_on_gpu_1", torch.nn.Identity())
    assert tensorrt_engines(holder) == 2
    assert tensorrt_engines(lambda *a: a) == 0, "a function holding no module has no engine"


def _aot_autograd_backend(convert: bool):
    """What Torch-TensorRT 2.12+'s backend does under distributed tracing (world size above 1) or
    for graphs with higher-order ops (``backends.py``): it returns
    ``aot_autograd(fw_compiler=functools.partial(_pretraced_backend, settings=...))(gm, inputs)``,
    a plain function; the forward compiler is where the engines are made."""
    import functools

    from torch._dynamo.backends.common import aot_autograd

    def pretraced_backend(gm, example_inputs, settings):
        if convert:
            gm.add_submodule("_run_on_acc_0", TorchTensorRTModule())
        return gm

    def backend(gm, sample_inputs, **kwargs):
        compiler = functools.partial(pretraced_backend, settings=kwargs.get("options"))
        return aot_autograd(fw_compiler=compiler)(gm, sample_inputs)

    return backend


def test_engines_behind_an_aot_autograd_function_are_counted():
    """Issue 55: from Torch-TensorRT 2.12 a torchrun process gets an aot_autograd function back; it
    counted no engine and the build failed with "converted no part"."""
    torch._dynamo.reset()
    module, graph, samples = _setup()
    compiled, counter = compile_counting(module, graph, samples, _aot_autograd_backend(True), {"min_block_size": 1})
    assert counter.engines >= 2, "an engine in each graph, found behind the function"
    with torch.no_grad():
        x = torch.randn(3, 8)
        assert torch.allclose(compiled(x), module(x))
    torch._dynamo.reset()
    with pytest.raises(BuildError, match="no part of the"):  # and none found is still none
        compile_counting(module, graph, samples, _aot_autograd_backend(False), {"min_block_size": 1})
    torch._dynamo.reset()


def test_the_parts_left_to_pytorch_follow_torchs_tf32_flags(monkeypatch):
    from aitune_backend_torchtrt import backend as module

    backend = TorchTensorRTJitBackend()
    monkeypatch.setattr(module, "torch_allows_tf32", lambda: True)
    backend.build_info["pytorch_subgraphs"] = 0
    assert not backend.computes_tf32(), "all in TensorRT with disable_tf32: full fp32"
    backend.build_info["pytorch_subgraphs"] = 1
    assert backend.computes_tf32()
    tf32 = TorchTensorRTJitBackend(TorchTensorRTJitBackendConfig(compile_config=TorchTensorRTConfig(tf32=True)))
    assert tf32.computes_tf32()


@pytest.mark.gpu
def test_on_a_gpu_a_jit_build_below_min_block_size_fails_and_one_above_counts_its_engines(tmp_path):
    from aitune.backend import BuildContext
    from aitune_backend_torchtrt.versions import runtime_problem

    if runtime_problem():
        pytest.skip(runtime_problem())
    cuda = torch.device("cuda")
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval().to(cuda)
    samples = [Sample((torch.randn(b, 8, device=cuda),)) for b in (2, 5)]
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])

    def build(min_block_size):
        torch._dynamo.reset()
        config = TorchTensorRTJitBackendConfig(compile_config=TorchTensorRTConfig(min_block_size=min_block_size))
        backend = TorchTensorRTJitBackend(config)
        backend.build(module, BuildContext(graph, samples, cuda, tmp_path, tmp_path))
        return backend

    with pytest.raises(BuildError, match="no part of the"):
        build(1000)
    backend = build(1)
    assert backend.build_info["tensorrt_subgraphs"] >= 1
