"""TorchInductorJitBackend on CPU: dynamic batch, graph breaks, fullgraph, save and load."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from aitune.backend import BuildContext, LoadContext
from aitune.converter import unstructure
from aitune.errors import BuildError
from aitune.graph import Sample, infer_graph
from aitune.testing import TinyMLP, assert_matches_eager, tiny_samples
from aitune.testing.conformance import run_in_fresh_process
from aitune.validation import validate
from aitune_backend_inductor.config import TorchInductorJitBackendConfig
from aitune_backend_inductor.jit import TorchInductorJitBackend


class WithBreak(torch.nn.Module):
    """Two graphs for Dynamo: the explicit break splits the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.fc(x))
        torch._dynamo.graph_break()
        return y * 2


class SizeBranch(torch.nn.Module):
    """Python control flow on the batch size: Dynamo specializes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.shape[0] > 4 else x + 1


@pytest.fixture(scope="module")
def dynamic_mlp(build):
    module = TinyMLP().eval()
    backend, graph = build(TorchInductorJitBackend(), module, tiny_samples(batch_sizes=(1, 8)))
    return backend, graph, module


def test_dynamic_batch_matches_eager_without_compiling_at_call(dynamic_mlp) -> None:
    backend, graph, module = dynamic_mlp
    assert (graph.batch.min, graph.batch.max) == (1, 8)
    x = torch.randn(3, 16)
    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
        got = backend.infer(x)
    assert_matches_eager(got, module(x).detach())
    assert backend.build_info["dynamic_dims"] == ["batch"]
    assert "batch=" in backend.build_info["checked_no_recompile_at"]


def test_validates_against_eager(dynamic_mlp) -> None:
    backend, graph, module = dynamic_mlp
    with torch.no_grad():
        report = validate(backend, module, tiny_samples(batch_sizes=(1, 8)), graph)
    assert report.passed, report.reason


def test_graph_breaks_are_counted_even_when_already_compiled(build) -> None:
    samples = tiny_samples(batch_sizes=(2, 4))
    for _ in range(2):  # the second build hits Dynamo's cache; the count must not drop to zero
        module = WithBreak().eval()
        backend, graph = build(TorchInductorJitBackend(), module, samples)
        assert backend.build_info["graph_breaks"] == 1
        assert backend.build_info["graphs"] == 2
        assert any("graph_break()" in r for r in backend.build_info["break_reasons"])
    with torch.no_grad():
        report = validate(backend, module, samples, graph)
    assert report.passed, report.reason


def test_fullgraph_fails_on_a_graph_break_naming_it(build) -> None:
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(fullgraph=True))
    with pytest.raises(BuildError, match=r"fullgraph=True.*graph_break\(\).*test_jit\.py"):
        build(backend, WithBreak().eval(), tiny_samples(batch_sizes=(2, 4)))


def test_a_module_that_fixes_its_batch_size_fails_the_build(build) -> None:
    with pytest.raises(BuildError, match="would compile again at run time"):
        build(TorchInductorJitBackend(), SizeBranch(), tiny_samples(batch_sizes=(1, 8)))


def test_static_only_config_refuses_a_dynamic_graph(dynamic_mlp) -> None:
    _, graph, _ = dynamic_mlp
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(dynamic=False))
    reason = backend.unsupported_reason(graph, torch.device("cpu"))
    assert reason is not None and "batch 1..8" in reason


def test_build_leaves_the_module_unchanged(dynamic_mlp) -> None:
    _, _, module = dynamic_mlp
    fresh = TinyMLP().eval()
    assert type(module) is TinyMLP
    for (name, p), q in zip(module.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name


def test_save_then_load_in_a_fresh_process_recompiles_and_matches(dynamic_mlp, tmp_path: Path) -> None:
    backend, graph, _ = dynamic_mlp
    payload = tmp_path / "payload"
    payload.mkdir()
    metadata = backend.save(payload)
    assert metadata["recompile_on_load"] is True
    assert list(payload.iterdir()) == [], "nothing compiled is saved"
    (tmp_path / "graph.json").write_text(json.dumps(unstructure(graph)))
    (tmp_path / "metadata.json").write_text(json.dumps(metadata))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = backend.infer(x)

    got = run_in_fresh_process(
        f"""
        import json, torch
        from pathlib import Path
        from aitune.backend import LoadContext
        from aitune.converter import structure
        from aitune.graph import GraphSpec
        from aitune.testing import TinyMLP
        from aitune_backend_inductor.jit import TorchInductorJitBackend

        tmp = Path({str(tmp_path)!r})
        graph = structure(json.loads((tmp / "graph.json").read_text()), GraphSpec)
        context = LoadContext(graph, torch.device("cpu"), json.loads((tmp / "metadata.json").read_text()), tmp / "cache")
        backend = TorchInductorJitBackend()
        backend.load(TinyMLP().eval(), tmp / "payload", context)
        x = torch.randn(5, 16, generator=torch.Generator().manual_seed(7))
        with torch.compiler.set_stance("fail_on_recompile"):
            y = backend.infer(x)
        print(json.dumps({{"y": y.tolist(), "compiled_on_load": backend.build_info["compiled_on_load"]}}))
        """
    )
    assert got["compiled_on_load"] is True
    assert_matches_eager(torch.tensor(got["y"]), want)


def test_load_in_process_uses_the_graph_shapes(dynamic_mlp, tmp_path: Path) -> None:
    backend, graph, module = dynamic_mlp
    loaded = TorchInductorJitBackend()
    with torch.no_grad():
        loaded.load(module, tmp_path, LoadContext(graph, torch.device("cpu"), backend.save(tmp_path), tmp_path))
    assert loaded.build_info["compiled_on_load"] is True
    assert loaded.build_info["warmup_shapes"][1:] == ["batch=1", "batch=8"]
    x = torch.randn(6, 16)
    with torch.no_grad():
        assert_matches_eager(loaded.infer(x), module(x))


@pytest.mark.gpu
def test_cuda_build_matches_eager(build, tmp_path: Path) -> None:
    from aitune.backend import BuildContext
    from aitune.graph import infer_graph

    module = TinyMLP().eval().cuda()
    samples = tiny_samples(batch_sizes=(1, 8), device="cuda")
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
        for config in (TorchInductorJitBackendConfig(), TorchInductorJitBackendConfig(mode="reduce-overhead")):
            backend = TorchInductorJitBackend(config)
            backend.build(module, BuildContext(graph, samples, torch.device("cuda"), tmp_path, tmp_path / "cache"))
            report = validate(backend, module, samples, graph)
            assert report.passed, (config, report.reason)


def test_a_module_dynamo_does_not_capture_is_refused(tmp_path):
    """nn.GRU is skipped by TorchDynamo: compiling it would only add guard checks to eager."""
    gru = torch.nn.GRU(8, 16, batch_first=True).eval()
    samples = [Sample((torch.randn(2, 5, 8),)), Sample((torch.randn(4, 5, 8),))]
    with torch.no_grad():
        graph = infer_graph(samples, ["input"], outputs=[gru(*s.args) for s in samples])
    context = BuildContext(graph, samples, torch.device("cpu"), tmp_path, tmp_path)
    with pytest.raises(BuildError, match="captured no graph"):
        TorchInductorJitBackend().build(gru, context)


class Stepped(torch.nn.Module):
    """Reads a Python int attribute the caller advances every call: Dynamo guards on its value."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.step + 1


def test_a_module_that_keeps_compiling_is_noticed_before_dynamos_limit(build) -> None:
    from aitune_backend_inductor.recompiles import RecompileRefused

    module = Stepped().eval()
    backend, _ = build(TorchInductorJitBackend(), module, tiny_samples(batch_sizes=(2, 2)))
    limit = backend._watch.limit
    x = torch.randn(2, 16)
    with torch.no_grad():
        for step in range(1, limit):  # compiles again, under the watch's limit: silent
            module.step = step
            assert torch.equal(backend.infer(x), x * step + 1)
        module.step = limit
        with pytest.warns(RuntimeWarning, match=r"compiled again \d+ times at run time.*step"):
            assert torch.equal(backend.infer(x), x * limit + 1)
        module.step = limit + 1
        with pytest.raises(RecompileRefused, match="would compile again"):
            backend.infer(x)  # the dispatcher runs such a call eager
        module.step = 1  # a value compiled before still runs compiled
        assert torch.equal(backend.infer(x), x + 1)


def _shared(forward):
    """A decorator whose one wrapper runs every decorated forward, as transformers 5's
    ``merge_with_config_defaults`` does for most of its models."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    return wrapper


class Shared(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, width)

    @_shared
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def test_builds_of_models_sharing_one_forward_code_keep_their_compiled_code_apart(build) -> None:
    """Dynamo keeps compiled code, and counts compiles against its limit of 8, per code object of the
    frame it starts from: builds of models sharing a forward (transformers 5's wrapper) piled up
    there, and once any compile of it hit the limit every one of them ran uncompiled without a word.
    Each build compiles in a region of its own (``isolate_recompiles``, torch 2.13)."""
    from aitune_backend_inductor.jit import ISOLATED

    if not ISOLATED:
        pytest.skip("this torch has no torch.compile(isolate_recompiles=...): builds share, as before")
    from torch._dynamo.eval_frame import _get_cache_entries_for_region

    shared_code = Shared.forward.__code__
    before = len(_get_cache_entries_for_region(shared_code, -1))
    built = [
        (build(TorchInductorJitBackend(), m, tiny_samples(batch_sizes=(2, 2)))[0], m) for m in (Shared(8), Shared(4))
    ]
    assert len(_get_cache_entries_for_region(shared_code, -1)) == before, "a build compiled into the shared region"
    x = torch.randn(2, 16)
    with torch.no_grad():
        other = torch.compile(Shared(3), backend="eager")  # someone else's plain compile of the same forward
        with torch._dynamo.config.patch(recompile_limit=1):
            for rows in (1, 3, 5):  # past the shared region's limit: it runs that forward uncompiled from now on
                other(torch.randn(rows, 16))
        with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
            for backend, module in built:  # each still runs its own compiled code: nothing compiles again
                assert_matches_eager(backend.infer(x), module(x))
                assert backend._watch.recompiles == 0
