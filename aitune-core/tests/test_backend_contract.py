"""The Backend contract: helpers backends share, and what BackendConformance catches."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aitune import hookimpl
from aitune.backend import Backend, BuildContext, exported_file
from aitune.errors import BuildError
from aitune.graph import GraphSpec, Sample, infer_graph
from aitune.registry import BackendRegistry, BackendSpec
from aitune.testing import BackendConformance
from aitune.testing.backends import ToyBackend, ToyConfig


def test_exported_file_accepts_only_plain_names_that_exist(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"x")
    assert exported_file(tmp_path, {"onnx": "model.onnx"}, "onnx") == tmp_path / "model.onnx"
    assert exported_file(tmp_path, {}, "onnx", "model.onnx") == tmp_path / "model.onnx"
    for hostile in ("../model.onnx", "/etc/passwd", "..", "", 3):
        with pytest.raises(BuildError, match="not a plain file name"):
            exported_file(tmp_path, {"onnx": hostile}, "onnx")
    with pytest.raises(BuildError, match="missing .* the export did not finish"):
        exported_file(tmp_path, {"onnx": "other.onnx"}, "onnx")


class InPlaceBackend(Backend):
    """Everything conformance must catch: converts the user's module in place and trains it."""

    name = "in_place"
    config_class = ToyConfig

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        self.module = module.train().to(torch.float64)

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*(a.to(torch.float64) for a in args)).float()


class InPlaceConformance(BackendConformance):
    backend_name = "in_place"


class Images(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class FourDimensionalOnly(ToyBackend):
    """A backend for images only, like the example plugin."""

    name = "images_only"

    def unsupported_reason(self, graph: GraphSpec, device: torch.device) -> str | None:
        return None if any(t.rank == 4 for t in graph.inputs) else "needs 4-D inputs"


class ImagesConformance(BackendConformance):
    backend_name = "images_only"

    def make_module(self) -> torch.nn.Module:
        return Images().eval()

    def make_samples(self) -> list[Sample]:
        return [Sample((torch.randn(b, 3, 8, 8),)) for b in (2, 4)]


class DefaultSamplesConformance(ImagesConformance):
    make_module = BackendConformance.make_module
    make_samples = BackendConformance.make_samples


def _plugin(*classes: type[Backend]) -> object:
    class Plugin:
        @hookimpl
        def aitune_register_backends(self, registry: BackendRegistry) -> None:
            for cls in classes:
                registry.add(BackendSpec(backend_class=f"{__name__}:{cls.__name__}"))

    return Plugin()


def test_conformance_fails_a_build_that_changes_the_users_module(register_plugin, tmp_path, monkeypatch):
    register_plugin(_plugin(InPlaceBackend))
    with pytest.raises(AssertionError, match="build\\(\\) changed the user's module") as failure:
        InPlaceConformance().test_build_infer_save_load(tmp_path, monkeypatch)
    assert "(root) switched to training mode" in str(failure.value)
    assert "tensor fc1.weight changed dtype" in str(failure.value)


def test_conformance_runs_on_the_samples_the_plugin_declares(register_plugin, tmp_path, monkeypatch):
    register_plugin(_plugin(FourDimensionalOnly))
    (tmp_path / "images").mkdir()
    (tmp_path / "default").mkdir()
    ImagesConformance().test_build_infer_save_load(tmp_path / "images", monkeypatch)
    with pytest.raises(
        AssertionError, match="refuses the conformance graph \\(needs 4-D inputs\\); override make_module"
    ):
        DefaultSamplesConformance().test_build_infer_save_load(tmp_path / "default", monkeypatch)


class Sleeper(torch.nn.Module):
    """A plugin author's own sleeping module: the toy backend's speed scales any ``delay_s``."""

    def __init__(self) -> None:
        super().__init__()
        self.delay_s, self.per_row_s = 0.5, 0.25
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_the_toy_backend_scales_the_sleep_of_any_module_once(tmp_path):
    import aitune.torch as ait

    inner = Sleeper()
    model = torch.nn.Sequential(ait.Module(inner, "sleeper"))  # the wrapper forwards delay_s: not scaled twice
    samples = [Sample((torch.zeros(2, 4),))]
    context = BuildContext(infer_graph(samples, ["x"]), samples, torch.device("cpu"), tmp_path, tmp_path)
    backend = ToyBackend(ToyConfig(speed=0.5))
    backend.build(model, context)
    copied = backend.module[0].module
    assert (copied.delay_s, copied.per_row_s) == (0.25, 0.125)
    assert (inner.delay_s, inner.per_row_s) == (0.5, 0.25), "the user's module keeps its sleep"
