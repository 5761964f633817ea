"""The example plugin as its users meet it: installed, discovered, conformant, and tuning a CNN."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import torch
from aitune_backend_example.backend import ChannelsLastBackend, ChannelsLastConfig
from cnn_model import SmallCNN

import aitune.torch as ait
from aitune.graph import Sample
from aitune.testing import BackendConformance, assert_matches_eager
from aitune.testing.conformance import run_in_fresh_process


def images(*batches: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, 3, 16, 16, generator=g) for b in batches]


class TestChannelsLastConformance(BackendConformance):
    backend_name = "channels_last"

    def make_module(self) -> torch.nn.Module:
        return SmallCNN().eval()

    def make_samples(self) -> list[Sample]:
        return [Sample((x,)) for x in images(2, 4)]


def test_the_plugin_is_found_through_its_installed_entry_point():
    [ep] = [ep for ep in importlib.metadata.entry_points(group="aitune") if ep.name == "channels_last"]
    assert ep.dist is not None and ep.dist.name == "aitune-backend-example"
    from aitune.plugins import get_manager

    registry = get_manager().registry
    assert registry.distribution("channels_last") == "aitune-backend-example"
    assert not registry.spec("channels_last").default_candidate, "an opt-in backend joins no default tune"


def test_folds_batchnorm_and_runs_channels_last():
    module = SmallCNN().eval()
    backend = ChannelsLastBackend()
    (x,) = images(3)
    tuned = ait.Module(module, "cnn", strategy=ait.OneBackendStrategy(backend).enable_performance_validation(False))
    ait.tune(tuned, images(2, 4))
    built = tuned.tuned_graphs[0][1]
    assert built.build_info["folded"] == ["features.0", "features.3"]
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in built.module.modules())
    assert built.module.features[0].weight.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert_matches_eager(tuned(x), module(x))
    assert isinstance(module.features[1], torch.nn.BatchNorm2d), "the user's module keeps its BatchNorm"


def test_outputs_keep_the_nchw_layout_unless_asked():
    module = torch.nn.Conv2d(3, 4, 1).eval()
    (x,) = images(2)
    for contiguous in (True, False):
        backend = ChannelsLastBackend(ChannelsLastConfig(contiguous_outputs=contiguous))
        backend.module = module.to(memory_format=torch.channels_last)
        with torch.no_grad():
            assert backend.infer(x).is_contiguous() is contiguous


def test_a_graph_without_4d_inputs_is_refused_before_building():
    tuned = ait.Module(torch.nn.Linear(4, 4).eval(), "mlp", strategy=ait.FirstWinsStrategy([ChannelsLastBackend()]))
    report = ait.tune(tuned, [torch.randn(2, 4), torch.randn(3, 4)])
    [candidate] = [c for c in report.modules[0].graphs[0].candidates if c.backend == "channels_last"]
    assert (candidate.status, candidate.stage) == ("failed", "availability")
    assert "4-D" in (candidate.reason or "")
    assert report.modules[0].graphs[0].decision == "torch_eager"


def test_tunes_saves_and_loads_in_a_fresh_process(tmp_path: Path):
    strategy = ait.OneBackendStrategy(ChannelsLastBackend()).enable_performance_validation(False)
    tuned = ait.Module(SmallCNN().eval(), "cnn", strategy=strategy)
    ait.tune(tuned, images(2, 4))
    artifact = ait.save(tuned, tmp_path / "cnn.ait")
    (x,) = images(3, seed=7)
    torch.save(x, tmp_path / "x.pt")
    with torch.no_grad():
        want = tuned(x)
    result = run_in_fresh_process(
        f"""
        import json, torch
        import aitune.torch as ait
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from cnn_model import SmallCNN
        model = ait.load(ait.Module(SmallCNN().eval(), "cnn"), {str(artifact)!r})
        with torch.no_grad():
            y = model(torch.load({str(tmp_path / "x.pt")!r}, weights_only=True))
        print(json.dumps({{"y": y.tolist(), "backends": [b.name for _, b in model.tuned_graphs]}}))
        """,
    )
    assert result["backends"] == ["channels_last"]
    assert_matches_eager(torch.tensor(result["y"]), want)
