"""The report names the size a figure was measured at by the axis it is the size of: ``batch 8`` for
the batch axis, and for a graph with no batch axis its first input's leading axis, by its
``DynamicDim`` name or by input and axis (a vision tower's patch count never reads as a batch)."""

from __future__ import annotations

import time

import pytest
import torch

import aitune.torch as ait
from aitune.render import render_markdown
from aitune.report import TuneReport, measured_at
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

pytestmark = pytest.mark.busy  # only words are checked, never which candidate won

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5), extend_s=0.0
)


class Patches(torch.nn.Module):
    """A vision tower's shape of call: ``pixel_values`` is [patches, channels], ``grid_thw`` one row per image."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(6, 4)
        self.delay_s = 0.001  # the toy backend drops it: a figure to report

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.proj(pixel_values) * grid_thw.sum()


class Rows(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 4)
        self.delay_s = 0.001

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.proj(x)


def _tune(module: torch.nn.Module, data: list, **kwargs) -> TuneReport:
    strategy = ait.MaxThroughputStrategy([ToyBackend(ToyConfig(speed=0.0))], profiling_config=QUICK)
    # no end-to-end gate: under a second busy process it may time the toy slower than eager and keep
    # eager, and its verdict then replaces the words that name the size
    module = ait.Module(module.eval(), "m", strategy=strategy, **kwargs)
    return ait.tune(module, data, show_progress=False, end_to_end=False)


def _calls(*patches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, 6, generator=g), torch.tensor([[1.0, 2.0, 2.0]])) for n in patches]


def _words(report: TuneReport) -> str:
    """The summary and every graph's reason: where the size appears whether the toy won or not."""
    [module] = report.modules
    return " ".join([module.summary, *(g.reason or "" for g in module.graphs)])


def test_a_patch_count_is_named_by_its_input_and_axis_not_batch(toy_backends) -> None:
    report = _tune(Patches(), _calls(16, 16))
    [graph] = report.modules[0].graphs
    assert graph.selected_batch_size == 16
    words = _words(report)
    assert "at pixel_values axis 0 = 16" in words, words
    assert "batch 16" not in words, words
    markdown = render_markdown(report)
    assert "at pixel_values axis 0 = 16" in markdown and "at batch 16" not in markdown
    again = TuneReport.from_json(report.to_json())  # a report read back says the same
    assert render_markdown(again) == markdown


def test_a_named_dynamic_dim_is_named_by_its_name(toy_backends) -> None:
    report = _tune(Patches(), _calls(16, 16, 20), dynamic_shapes={"pixel_values": {0: ait.DynamicDim("patches")}})
    words = _words(report)
    assert "at patches = 16" in words, words
    assert "batch" not in words.replace("per batch size", ""), words


def test_the_batch_axis_still_reads_batch(toy_backends) -> None:
    g = torch.Generator().manual_seed(0)
    report = _tune(Rows(), [torch.randn(b, 8, generator=g) for b in (2, 4)])
    words = _words(report)
    assert "at batch 4" in words, words
    assert "axis 0 =" not in words, words


def test_the_words_are_the_same_from_a_spec_and_from_its_json() -> None:
    from aitune.converter import unstructure
    from aitune.graph import DynamicDim, Sample, infer_graph

    one = infer_graph([Sample(c) for c in _calls(16)], ["pixel_values", "grid_thw"])
    named = infer_graph(
        [Sample(c) for c in _calls(16, 20)], ["pixel_values", "grid_thw"], {"pixel_values": {0: DynamicDim("patches")}}
    )
    batched = infer_graph([Sample((torch.randn(b, 8),)) for b in (2, 4)], ["x"])
    scalar = infer_graph([Sample((torch.tensor(3.0), torch.randn(2, 8)))], ["t", "x"])
    for graph, words in [
        (one, "pixel_values axis 0 = 16"),
        (named, "patches = 16"),
        (batched, "batch 16"),
        (scalar, "the recorded inputs"),
    ]:
        assert measured_at(graph, 16) == words
        assert measured_at(unstructure(graph), 16) == words
    assert measured_at({}, 16) == "batch 16"  # a graph the report does not hold (another rank's)
