"""torch_inductor_jit skips, before building, a module whose code fixes an axis the recorded calls vary."""

from __future__ import annotations

import pytest
import torch

from aitune.errors import BuildError
from aitune.graph import DimRange, Sample
from aitune_backend_inductor.jit import TorchInductorJitBackend
from aitune_backend_inductor.shapes import unwarmed_sizes


class Unrolled(torch.nn.Module):
    """A Python loop over axis 1: Dynamo unrolls it, so each width is its own compile."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = x[:, 0]
        for i in range(1, x.shape[1]):
            acc = acc + x[:, i] * i
        return acc


class Summed(torch.nn.Module):
    """The same reduction written over the axis: one compile covers every width."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * torch.arange(x.shape[1], dtype=x.dtype)).sum(1)


def widths(*sizes: int) -> list[Sample]:
    return [Sample((torch.randn(2, w),)) for w in sizes]


def test_a_module_that_fixes_a_varying_axis_is_skipped_before_it_is_built(build) -> None:
    backend = TorchInductorJitBackend()
    with pytest.raises(BuildError) as info:
        build(backend, Unrolled().eval(), widths(2, 12))
    message = str(info.value)
    assert "fixes the dynamic dimension d0 ('x' axis 1, 2..12" in message
    assert "9 sizes the warm-up does not cover" in message and "skipped before it is built" in message
    assert "warmup_shapes" not in backend.build_info  # Inductor compiled no warm-up case


def test_a_module_dynamic_over_the_varying_axis_is_still_built(build) -> None:
    module = Summed().eval()
    backend, _ = build(TorchInductorJitBackend(), module, widths(2, 12))
    assert backend.build_info["dynamic_dims"] == ["d0"]
    x = torch.randn(2, 9)  # a width no warm-up used
    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
        assert torch.allclose(backend.infer(x), module(x))


def test_unwarmed_sizes_counts_the_range_from_2_and_picks_the_middle_first() -> None:
    assert unwarmed_sizes(DimRange(1, 1, 12), [1, 2, 12]) == (9, [7, 6])
    assert unwarmed_sizes(DimRange(1, 1, 3), [1, 3]) == (1, [2])
