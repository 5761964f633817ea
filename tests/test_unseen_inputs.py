"""Real exporting backends on what the recorded calls never exercised: a shape branch, a value
branch, hooks and ``.data`` edits after tuning. Each gives eager's answer or runs eager with a warning."""

from __future__ import annotations

import warnings

import pytest
import torch

import aitune.torch as ait
from aitune.plugins import get_manager
from aitune.testing import assert_matches_eager


def _onnxruntime(**config):
    registry = get_manager().registry
    if "onnxruntime" not in registry or registry.status("onnxruntime").reason("cpu"):
        pytest.skip("onnxruntime cannot run here")
    from aitune.torch.backend import ONNXRuntimeBackend, ONNXRuntimeBackendConfig

    return ONNXRuntimeBackend(ONNXRuntimeBackendConfig(**config))


class ShapeBranch(torch.nn.Module):
    """Takes another path at length 6, a length the recorded calls (4 and 8) never had."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        if x.shape[1] == 6:
            return y * -3.0
        return y


class ValueBranch(torch.nn.Module):
    """Takes another path when the data's sum is negative, which the recorded data never was."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() < -1000:
            return y * 100.0
        return y


def test_a_shape_branch_between_recorded_lengths_gets_eagers_answer():
    model = ait.Module(
        ShapeBranch().eval(), "shape", strategy=ait.FirstWinsStrategy([_onnxruntime()], performance_validation=False)
    )
    report = ait.tune(model, [torch.randn(2, 4, 8), torch.randn(2, 8, 8)])
    x = torch.randn(2, 6, 8)
    with torch.no_grad():
        assert_matches_eager(model(x), model.module(x))
    candidate = report.modules[0].graphs[0].candidates[0]
    if candidate.status == "not applicable":  # the export judged its size condition (Ne(d0, 6)) and refused it
        assert "d0=6" in (candidate.reason or ""), candidate.reason
    elif candidate.status != "failed":  # the export kept the branch: then validation looked at 6 and it held
        assert any("unrecorded" in c for c in candidate.validation.checks)


def test_the_torchscript_fallback_is_refused_for_a_value_branch_unless_asked_for():
    data = [torch.randn(2, 8).abs(), torch.randn(4, 8).abs()]
    model = ait.Module(
        ValueBranch().eval(), "value", strategy=ait.FirstWinsStrategy([_onnxruntime()], performance_validation=False)
    )
    report = ait.tune(model, data)
    candidate = report.modules[0].graphs[0].candidates[0]
    assert candidate.status == "failed" and model.state != "tuned"
    assert "TorchScript tracer reports data-dependent control flow" in candidate.reason, candidate.reason
    assert "trace_control_flow=True" in candidate.reason, "the reason says how to opt in"
    x = torch.full((2, 8), -1000.0)  # the branch no recorded call took
    with torch.no_grad():
        assert_matches_eager(model(x), model.module(x))

    from aitune.onnx_export import ONNXExportConfig

    opted = _onnxruntime(export=ONNXExportConfig(exporter="torchscript", trace_control_flow=True))
    model = ait.Module(
        ValueBranch().eval(), "opted", strategy=ait.FirstWinsStrategy([opted], performance_validation=False)
    )
    ait.tune(model, data)
    assert model.state == "tuned", model.report.summary


def test_hooks_and_data_edits_after_tuning_reach_an_onnxruntime_winner():
    model = ait.Module(
        ShapeBranch().eval(), "hooks", strategy=ait.FirstWinsStrategy([_onnxruntime()], performance_validation=False)
    )
    ait.tune(model, [torch.randn(2, 4, 8), torch.randn(3, 4, 8)])
    assert model.state == "tuned"
    x = torch.randn(2, 4, 8)
    handle = model.module.fc.register_forward_hook(lambda module, args, out: out + 1.0)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="hooks were added"):
        assert_matches_eager(model(x), model.module(x))
    handle.remove()
    model.module.fc.weight.data.mul_(2)
    model.eval()  # seen here: the winner is refitted with the edited weights and checked against eager
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_matches_eager(model(x), model.module(x))
    assert model.stale_reason is None and model.tuned_graphs[0].backend.build_info["refitted"]
