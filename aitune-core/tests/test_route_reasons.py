"""Why a call fits none of a module's routes names only what the routes that hold its sizes lack:
a call at batch 1, which a batch-1 route serves, is never told to widen another route's batch range."""

from __future__ import annotations

import torch

from aitune.engine.graph_tuning import narrow
from aitune.graph import Sample, infer_graph, outside


class Steps(torch.nn.Module):
    """Rows of steps: a call's shape is [batch, steps]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cumsum(-1)


def _routes() -> list:
    """The routes of a graph tuned for batch 1..8 and split at 2, as a per-batch-size decision makes
    them (a static batch-1 build beside a dynamic one for 2..8): the spec of each batch range."""
    module = Steps()
    samples = [Sample((torch.randn(b, 8),)) for b in (1, 2, 8)]
    graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    assert graph.batch is not None and (graph.batch.min, graph.batch.max) == (1, 8)
    return [narrow(graph, 1, 1), narrow(graph, 2, 8)]


def test_a_batch_one_call_is_told_what_its_own_route_lacks_not_to_widen_another_range() -> None:
    routes = _routes()
    call = [torch.randn(1, 9)]
    assert "BatchDim" in (routes[1].mismatch(call) or "")  # what the 2..8 route alone would say
    reason = outside(routes, call)
    assert reason.startswith("x: axis 1 is 9, tuned for the static size 8"), reason
    assert "BatchDim" not in reason and "batch" not in reason, reason


def test_a_batch_outside_every_route_is_said_once_against_all_their_ranges() -> None:
    reason = outside(_routes(), [torch.randn(9, 8)])
    assert reason == (
        "x: axis 0 (batch) is 9, tuned for 1..8; record a call of that size while tuning, "
        "or widen the range: dynamic_shapes={'x': {0: ait.BatchDim(min=1, max=9)}}"
    )


def test_a_gap_between_routes_is_shown_as_a_gap() -> None:
    module = Steps()
    samples = [Sample((torch.randn(b, 8),)) for b in (1, 8)]
    graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    reason = outside([narrow(graph, 1, 1), narrow(graph, 4, 8)], [torch.randn(2, 8)])
    assert "is 2, tuned for 1..1, 4..8;" in reason and "BatchDim(min=1, max=8)" in reason, reason


def test_a_call_is_told_what_the_route_holding_its_batch_lacks() -> None:
    routes = _routes()
    reason = outside(routes, [torch.randn(3, 9)])  # batch 3 is the 2..8 route's; its steps are off
    assert reason.startswith("x: axis 1 is 9, tuned for the static size 8"), reason
    assert reason.count("axis 1 is 9") == 1 and "BatchDim" not in reason, reason


def test_a_call_that_fits_a_route_has_no_reason() -> None:
    assert outside(_routes(), [torch.randn(3, 8)]) == ""


def test_one_graph_says_what_it_said_before() -> None:
    [whole] = _routes()[1:]
    assert outside([whole], [torch.randn(1, 8)]) == whole.mismatch([torch.randn(1, 8)])
    assert whole.mismatch([torch.randn(1, 8)]) == (
        "x: axis 0 (batch) is 1, tuned for 2..8; record a call of that size while tuning, "
        "or widen the range: dynamic_shapes={'x': {0: ait.BatchDim(min=1, max=8)}}"
    )
