"""Static-shape builds with a real backend (ONNX Runtime): tuned, routed, saved and loaded back.

Which build wins is scripted (a profiling clock with fixed figures), so nothing here races; what
is real is the build for one batch size, its payload in the artifact and the routing of calls.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import aitune.torch as ait
from aitune import hookimpl
from aitune.plugins import get_manager
from aitune.profiling import summarize
from aitune.testing import assert_matches_eager
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

pytestmark = pytest.mark.busy


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Clock:
    """Eager 3 ms, the dynamic build 2 ms, and in the session that pits a static build (the third
    runner) against the dynamic one, the static build 1 ms."""

    @hookimpl
    def aitune_profile(self, runners, batch_size, config, device):
        out = {}
        for key, run in runners.items():
            run()
            name, index = key.split("#")
            ms = 3.0 if name == "torch_eager" else 1.0 if index == "2" else 2.0
            out[key] = summarize([ms] * 4, batch_size, 1)
        return out


def input_dims(backend, folder) -> list:
    import onnx

    folder.mkdir()
    backend.save(folder)
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    [dims] = [[d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in proto.graph.input]
    return dims


def test_onnxruntime_static_builds_are_routed_saved_and_loaded(register_plugin, tmp_path):
    registry = get_manager().registry
    if "onnxruntime" not in registry or registry.status("onnxruntime").reason("cpu"):
        pytest.skip("ONNX Runtime is not installed here")
    from aitune.torch.backend import ONNXRuntimeBackend

    register_plugin(Clock())
    profiling = ProfilingConfig(
        measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=8, warmup=1, window=2),
        dispatch_cost_ms=0.0,
        extend_s=0.0,
    )
    strategy = ait.MaxThroughputStrategy([ONNXRuntimeBackend()], profiling, static_shapes=True)
    model = ait.Module(MLP().eval(), "mlp", strategy=strategy)
    g = torch.Generator().manual_seed(0)
    report = ait.tune(model, [torch.randn(b, 16, generator=g) for b in (2, 6, 2, 6)], end_to_end=False)
    [graph] = report.modules[0].graphs
    assert [(r.batch_min, r.batch_max, r.static) for r in graph.routes] == [(2, 2, True), (6, 6, True), (2, 6, False)]

    saved = ait.save(model, tmp_path / "mlp.ait")
    loaded = ait.load(ait.Module(MLP().eval(), "mlp"), saved)
    assert [(g.batch.min, g.batch.max) for g, _ in loaded.tuned_graphs] == [(2, 2), (6, 6), (2, 6)]
    assert input_dims(loaded.tuned_graphs[1][1], tmp_path / "static") == [6, 16], "the artifact kept the static model"
    assert isinstance(input_dims(loaded.tuned_graphs[2][1], tmp_path / "dynamic")[0], str)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # a static model handed another batch size would raise, then warn
        for batch in (2, 4, 6):
            x = torch.randn(batch, 16)
            with ait.observe_routes() as seen:
                out = loaded(x)
            assert [r.backend for r in seen] == ["onnxruntime"]
            assert_matches_eager(out, loaded.module(x))
