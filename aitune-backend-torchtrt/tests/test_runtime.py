"""The torch / torch-tensorrt version coupling, missing-runtime reports, and what building here says."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch

from aitune.backend import BuildContext
from aitune.errors import BackendUnavailableError
from aitune.plugins import get_manager
from aitune.testing import assert_matches_eager
from aitune_backend_torchtrt import versions
from aitune_backend_torchtrt.backend import TorchTensorRTAotBackend, TorchTensorRTJitBackend, compile_and_warm

MISMATCH = "torch-tensorrt 2.13.0 needs torch 2.13.x, found 2.14.1"


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch):
    """Pretend these distributions are installed (None: not installed); others keep their real versions."""

    def install(**found: str | None) -> None:
        real = importlib.metadata.version
        table = {name.replace("_", "-"): v for name, v in found.items()}

        def version(name: str) -> str:
            if name in table:
                if table[name] is None:
                    raise importlib.metadata.PackageNotFoundError(name)
                return table[name]  # type: ignore[return-value]
            return real(name)

        monkeypatch.setattr(importlib.metadata, "version", version)

    return install


@pytest.mark.parametrize(
    ("trt", "torch_version"), [("2.13.0", "2.13.0+cpu"), ("2.13.1", "2.13.0"), ("2.8.0+cu126", "2.8.0+cu126")]
)
def test_matching_minor_versions_are_fine(trt: str, torch_version: str) -> None:
    assert versions.coupling_problem(trt, torch_version) is None


def test_a_mismatch_is_reported_in_words() -> None:
    problem = versions.coupling_problem("2.13.0", "2.14.1+cu128")
    assert problem is not None and problem.startswith(MISMATCH)
    assert "torch-tensorrt==2.14.*" in problem, "says which release to install instead"


def test_torch_outside_the_tested_range_is_reported_with_the_pair_to_install() -> None:
    old = versions.coupling_problem("2.7.0", "2.7.1+cu126")
    assert "torch 2.7.1 is outside" in old and "layout aitune's archive check does not read" in old
    assert "aitune-backend-torchtrt[torch214]" in old
    assert "outside" in versions.coupling_problem("2.15.0", "2.15.0")


def test_the_install_hint_names_the_extra_that_pins_this_torch() -> None:
    assert versions.install_hint("2.13.0+cu128") == "pip install 'aitune-backend-torchtrt[torch213]'"
    assert versions.install_hint("2.9.1") == "pip install 'aitune-backend-torchtrt[torch29]'"


def test_each_extra_pins_one_torch_minor_to_its_torch_tensorrt() -> None:
    from packaging.requirements import Requirement

    requires = [Requirement(r) for r in importlib.metadata.requires("aitune-backend-torchtrt") or []]
    base = {r.name: r for r in requires if r.marker is None}
    assert not base["torch"].specifier.contains("2.7.1") and "torch-tensorrt" not in base, "never swaps torch"
    for mnr in range(versions.TESTED[0][1], versions.TESTED[1][1] + 1):
        pinned = {
            r.name: r
            for r in requires
            if r.marker is not None and r.marker.evaluate({"extra": f"torch2{mnr}", "platform_system": "Linux"})
        }
        for name in ("torch", "torch-tensorrt"):
            spec = pinned[name].specifier
            assert (
                spec.contains(f"2.{mnr}.1")
                and not spec.contains(f"2.{mnr + 1}.0")
                and not spec.contains(f"2.{mnr - 1}.0")
            )


def test_the_mismatch_shows_in_the_backend_listing(installed) -> None:
    installed(torch_tensorrt="2.13.0", torch="2.14.1")
    status = get_manager().registry.status("torch_tensorrt_aot")
    assert not status.available
    assert MISMATCH in (status.reason("cuda") or "")


def test_a_missing_runtime_is_reported_with_the_install_hint(installed) -> None:
    installed(torch_tensorrt=None)
    hint = versions.install_hint()
    assert hint == f"pip install 'aitune-backend-torchtrt[torch2{torch.__version__.split('.')[1]}]'"
    assert versions.runtime_problem() == f"torch-tensorrt is not installed; install it with: {hint}"
    reason = get_manager().registry.status("torch_tensorrt_jit").reason("cuda") or ""
    assert "torch-tensorrt" in reason and hint in reason


def _context(tmp_path: Path, make_samples, make_graph, encoder, device: str) -> BuildContext:
    samples = make_samples()
    return BuildContext(make_graph(encoder, samples), samples, torch.device(device), tmp_path, tmp_path)


@pytest.mark.parametrize("backend_class", [TorchTensorRTJitBackend, TorchTensorRTAotBackend])
def test_building_without_the_runtime_says_what_to_install(
    backend_class, installed, tmp_path, make_samples, make_graph, encoder
) -> None:
    installed(torch_tensorrt=None)
    with pytest.raises(BackendUnavailableError, match=r"not installed.*aitune-backend-torchtrt\[torch2\d+\]"):
        backend_class().build(encoder, _context(tmp_path, make_samples, make_graph, encoder, "cuda"))


@pytest.mark.parametrize("backend_class", [TorchTensorRTJitBackend, TorchTensorRTAotBackend])
def test_building_with_a_mismatched_pair_raises_the_mismatch(
    backend_class, installed, tmp_path, make_samples, make_graph, encoder
) -> None:
    installed(torch_tensorrt="2.13.0", torch="2.14.1")
    with pytest.raises(BackendUnavailableError, match=MISMATCH):
        backend_class().build(encoder, _context(tmp_path, make_samples, make_graph, encoder, "cuda"))


@pytest.mark.parametrize("backend_class", [TorchTensorRTJitBackend, TorchTensorRTAotBackend])
def test_building_for_the_cpu_is_refused_before_any_import(
    backend_class, installed, tmp_path, make_samples, make_graph, encoder
) -> None:
    installed(torch_tensorrt=torch.__version__.split("+")[0])
    context = _context(tmp_path, make_samples, make_graph, encoder, "cpu")
    assert "CUDA devices only" in (backend_class().unsupported_reason(context.graph, context.device) or "")
    with pytest.raises(BackendUnavailableError, match="CUDA devices only"):
        backend_class().build(encoder, context)


def test_compile_and_warm_leaves_no_compile_for_in_range_calls(make_samples, make_graph, encoder) -> None:
    """The JIT build's warm-up, run with a counting torch.compile backend in place of Torch-TensorRT."""
    torch._dynamo.reset()
    compiles: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compiles.append(1)
        return gm.forward

    samples = make_samples()
    graph = make_graph(encoder, samples)
    before = {k: v.clone() for k, v in encoder.state_dict().items()}
    compiled = compile_and_warm(encoder, graph, samples, counting)
    warmed = len(compiles)
    assert warmed >= 1
    for b, s in [(3, 6), (2, 6), (3, 5)]:
        sample = make_samples(((b, s),))[0]
        with torch.no_grad():  # as the backend's infer() runs it
            got = compiled(*sample.args, **sample.kwargs)
        assert_matches_eager(got, encoder(*sample.args, **sample.kwargs))
    assert len(compiles) == warmed, "a call inside the tuned ranges compiled again"
    assert all(torch.equal(before[k], v) for k, v in encoder.state_dict().items())
    torch._dynamo.reset()
