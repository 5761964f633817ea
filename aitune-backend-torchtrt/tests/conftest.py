"""Shared test models: a tiny encoder with the input structure of a real one (batch and sequence shared by two inputs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aitune.graph import GraphSpec, Sample, infer_graph


class TinyEncoder(torch.nn.Module):
    """``x`` [batch, seq, 4] and ``mask`` [batch, seq] share both dims; ``bias`` is static and keyword-only."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.proj = torch.nn.Linear(4, 8)
        with torch.no_grad():
            for p in self.proj.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, *, bias: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = torch.relu(self.proj(x)) * mask.unsqueeze(-1) + bias
        return {"pooled": hidden.sum(1), "hidden": hidden}


def encoder_samples(
    shapes: tuple[tuple[int, int], ...] = ((2, 5), (3, 7), (2, 7)), device: str = "cpu"
) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(8, generator=g)
    return [
        Sample(
            (torch.randn(b, s, 4, generator=g).to(device), torch.ones(b, s).to(device)),
            {"bias": bias.to(device)},
        )
        for b, s in shapes
    ]


def encoder_graph(module: torch.nn.Module, samples: list[Sample], **kwargs: object) -> GraphSpec:
    with torch.no_grad():
        outputs = [module(*s.args, **s.kwargs) for s in samples]
    return infer_graph(samples, ["x", "mask"], outputs=outputs, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def encoder() -> TinyEncoder:
    return TinyEncoder().eval()


@pytest.fixture(scope="session")
def make_samples():
    return encoder_samples


@pytest.fixture(scope="session")
def make_graph():
    return encoder_graph


BASE_SETTINGS = (
    "workspace_size", "min_block_size", "truncate_double", "require_full_compilation", "torch_executed_ops",
    "sparse_weights", "hardware_compatible", "version_compatible", "disable_tf32", "optimization_level",
)  # fmt: skip
"""The compile settings every supported Torch-TensorRT release has, as far as aitune passes them."""


def release_settings(*extra: str) -> type:
    """A stand-in for a release's ``CompilationSettings`` dataclass: the base settings plus ``extra``.

    aitune reads only the field names (``known_settings``), so every field defaults to None.
    """
    return dataclasses.make_dataclass("CompilationSettings", [(n, object, None) for n in (*BASE_SETTINGS, *extra)])


@pytest.fixture(scope="session")
def make_release_settings():
    return release_settings
