"""Shared fixtures: tiny graphs with batch and dynamic axes, and their ONNX export (done once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aitune.graph import GraphSpec, Sample, infer_graph


class TwoInputs(torch.nn.Module):
    """Token ids and a mask sharing a sequence axis, plus a batch axis: the transformer-shaped case."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 8)
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids) * mask.unsqueeze(-1)
        return {"hidden": self.proj(h), "pooled": h.sum(dim=1)}


def two_input_samples(shapes: list[tuple[int, int]]) -> list[Sample]:
    g = torch.Generator().manual_seed(3)
    return [Sample((torch.randint(0, 50, (b, s), generator=g), torch.ones(b, s))) for b, s in shapes]


def graph_of(module: torch.nn.Module, samples: list[Sample], arg_names: list[str], **kw: object) -> GraphSpec:
    with torch.no_grad():
        outputs = [module(*s.args, **s.kwargs) for s in samples]
    return infer_graph(samples, arg_names, outputs=outputs, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def two_inputs() -> tuple[torch.nn.Module, list[Sample], GraphSpec]:
    module = TwoInputs().eval()
    samples = two_input_samples([(2, 5), (4, 7), (4, 7), (3, 12)])
    return module, samples, graph_of(module, samples, ["input_ids", "mask"])


@pytest.fixture(scope="session")
def mlp_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, list[Sample], GraphSpec, Path]:
    """TinyMLP over batches 2, 4, 4, 3 exported once by core's exporter (the slow step)."""
    from aitune.onnx_export import export_onnx
    from aitune.testing import TinyMLP, tiny_samples

    module = TinyMLP().eval()
    samples = tiny_samples((2, 4, 4, 3))
    graph = graph_of(module, samples, ["x"])
    exported = export_onnx(module, graph, samples[0], tmp_path_factory.mktemp("onnx"))
    return exported, samples, graph, exported.path.parent


@pytest.fixture
def make_graph() -> object:
    """``make_graph(module, samples, arg_names, **infer_graph_kwargs)`` -> GraphSpec."""
    return graph_of


@pytest.fixture
def make_two_input_samples() -> object:
    return two_input_samples
