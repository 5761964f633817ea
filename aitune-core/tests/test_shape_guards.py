"""The size conditions a ``torch.export`` capture holds, read as guards with sizes on their other side.

The ONNX graph made from such a capture keeps one side of each size comparison and drops the
condition; :func:`aitune.traced_branches.shape_guards` finds the sizes of the tuned range on the
other side, and :func:`~aitune.traced_branches.judge_guards` runs the capture there against eager.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from aitune.graph import DimRange, FlatModule, Sample, infer_graph
from aitune.traced_branches import judge_guards, shape_guards

TESTS = {
    "gt": lambda n: n > 100,
    "lt": lambda n: n < 100,
    "eq": lambda n: n == 100,
    "even": lambda n: n % 2 == 0,
    "none": lambda n: False,
}


class Branch(torch.nn.Module):
    def __init__(self, test: str, agree: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 4)
        self.test, self.agree = test, agree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if TESTS[self.test](x.shape[1]):
            return y + 0.0 if self.agree else y * -3.0
        return y


def _captured(module: torch.nn.Module, length: int):
    """``module`` captured at ``[2, length, 4]`` over lengths 8..512, as the dynamo exporter captures it."""
    from aitune.onnx_export import _capture, _dynamic_shapes

    samples = [Sample((torch.randn(2, n, 4),)) for n in (length, length + 4)]
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    [name] = graph.dims
    graph = attrs.evolve(graph, dims={name: DimRange(8, length, 512)})
    wrapper = FlatModule(module.eval(), graph)
    flat = tuple(graph.flatten(samples[0].args, samples[0].kwargs))
    with torch.no_grad():
        program = _capture(wrapper, flat, _dynamic_shapes(graph))
    return program, graph, wrapper, samples[0], {name: length}


@pytest.mark.parametrize(
    ("test", "length", "condition", "other_side"),
    [
        ("gt", 16, "8 <= d0 <= 100", [101, 512]),
        ("gt", 200, "101 <= d0 <= 512", [100, 8]),
        ("lt", 16, "8 <= d0 <= 99", [100, 512]),
        ("eq", 16, "Ne(d0, 100)", [100]),
        ("even", 16, None, [15, 17]),
    ],
)
def test_each_size_comparison_is_read_with_sizes_on_its_other_side(test, length, condition, other_side):
    program, graph, _, _, sizes = _captured(Branch(test), length)
    [guard] = shape_guards(program, graph, sizes)
    if condition is not None:
        assert guard.condition == condition
    else:
        assert "Mod(d0, 2)" in guard.condition, guard.condition
    assert [s["d0"] for s in guard.other_side][: len(other_side)] == other_side, guard.other_side


def test_code_without_a_size_comparison_holds_no_guard():
    program, graph, _, _, sizes = _captured(Branch("none"), 16)
    assert shape_guards(program, graph, sizes) == []


@pytest.mark.parametrize("test", ["gt", "eq", "even"])
def test_a_guard_whose_other_side_differs_is_refused_and_one_whose_sides_agree_is_kept(test):
    program, graph, wrapper, sample, sizes = _captured(Branch(test), 16)
    why, judged = judge_guards(program, wrapper, graph, sample, sizes)
    assert why is not None and "differs from eager" in why and judged == [], why

    program, graph, wrapper, sample, sizes = _captured(Branch(test, agree=True), 16)
    why, judged = judge_guards(program, wrapper, graph, sample, sizes)
    assert why is None, why
    [guard] = judged
    assert guard["kind"] == "size" and guard["other_side_checked"], guard


def test_a_value_read_from_a_tensor_is_not_a_size_guard():
    """``torch.export`` asserts on values it reads from tensors (unbacked symbols); those are not sizes."""

    class ReadsAValue(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            k = (x.abs().sum() > -1).long().item()
            torch._check(k <= 5)
            return x * k

    program, graph, _, _, sizes = _captured(ReadsAValue(), 16)
    asserted = [n for n in program.graph.nodes if n.target is torch.ops.aten._assert_scalar.default]
    assert asserted, "the capture holds an assertion on the value (u0 <= 5)"
    assert shape_guards(program, graph, sizes) == []
