"""A size comparison inside the tuned range (``if x.shape[1] > 100``) on ONNX Runtime.

Both ONNX exporters keep only the side of the comparison their sample took: ``torch.export``
narrows the dim's range or turns the comparison into a runtime assertion, which the ONNX graph
drops; the TorchScript trace freezes it. Tuned with lengths on one side of 100 only (issue 49: off
by 4.53 at the other), each export is now judged at sizes past the comparison and refused where it
differs from eager there, so every length gets eager's answer; one whose sides agree is kept.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import aitune.torch as ait
from aitune.plugins import get_manager
from aitune.testing import assert_matches_eager

LENGTHS = (8, 15, 99, 100, 101, 300, 512)


def _onnxruntime(exporter: str):
    registry = get_manager().registry
    if "onnxruntime" not in registry or registry.status("onnxruntime").reason("cpu"):
        pytest.skip("onnxruntime cannot run here")
    from aitune.onnx_export import ONNXExportConfig
    from aitune.torch.backend import ONNXRuntimeBackend, ONNXRuntimeBackendConfig

    return ONNXRuntimeBackend(
        ONNXRuntimeBackendConfig(export=ONNXExportConfig(exporter=exporter, fallback_to_torchscript=False))
    )


class SizeBranch(torch.nn.Module):
    """``[batch, length, 8]``; past length 100 (or at exactly 100) another answer, or the same one by
    another path when ``agree``."""

    def __init__(self, test: str, agree: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)
        self.test = test
        self.agree = agree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if (n > 100) if self.test == ">" else (n == 100):
            return self.fc(x.contiguous()) if self.agree else self.fc(x) * -3.0
        return self.fc(x)


def _tuned(module: torch.nn.Module, lengths: tuple[int, ...], exporter: str) -> tuple[ait.Module, object]:
    model = ait.Module(
        module.eval(),
        "branch",
        strategy=ait.FirstWinsStrategy([_onnxruntime(exporter)], performance_validation=False),
        dynamic_shapes={"x": {1: ait.DynamicDim(min=8, max=512)}},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "tuning found no winner", when refused
        report = ait.tune(model, [torch.randn(2, n, 8) for n in lengths], end_to_end=False)
    return model, report.modules[0].graphs[0].candidates[0]


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize(
    ("test", "lengths"),
    [(">", (16, 64)), (">", (128, 400)), ("==", (16, 64))],
    ids=["above-100-tuned-below", "above-100-tuned-above", "at-100-tuned-elsewhere"],
)
def test_a_size_branch_inside_the_tuned_range_gets_eagers_answer_at_every_length(exporter, test, lengths):
    model, candidate = _tuned(SizeBranch(test), lengths, exporter)
    for n in LENGTHS:
        x = torch.randn(2, n, 8)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert_matches_eager(model(x), model.module(x))
    assert candidate.status == "not applicable", (candidate.status, candidate.reason)
    assert model.state != "tuned"
    if exporter == "dynamo":
        assert "size comparison" in candidate.reason and "differs from eager" in candidate.reason, candidate.reason
        where = "d0=100, past Ne(d0, 100)" if test == "==" else ("d0=101, past" if lengths[0] < 100 else "d0=100, past")
        assert where in candidate.reason, candidate.reason
    else:
        assert "data-dependent control flow" in candidate.reason and "differs from eager" in candidate.reason


def test_a_size_branch_whose_sides_agree_is_judged_and_kept():
    model, candidate = _tuned(SizeBranch(">", agree=True), (16, 64), "dynamo")
    assert model.state == "tuned", candidate.reason
    [guard] = candidate.build_info["traced_branches"]
    assert guard["kind"] == "size" and guard["site"] == "8 <= d0 <= 100" and guard["other_side_checked"], guard
    assert "d0=101" in guard["other_side"] and "d0=512" in guard["other_side"], guard
    for n in (101, 512):
        x = torch.randn(2, n, 8)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")  # served by ONNX Runtime, no eager fallback
            assert_matches_eager(model(x), model.module(x))
