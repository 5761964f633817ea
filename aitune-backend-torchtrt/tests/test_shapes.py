"""Graph spec -> torch.export dims and Torch-TensorRT input profiles, checked with a real torch.export on CPU."""

from __future__ import annotations

import pytest
import torch

from aitune.graph import DynamicDim
from aitune.testing import assert_matches_eager
from aitune_backend_torchtrt.shapes import (
    dynamic_shapes,
    export_dim_names,
    export_dims,
    export_program,
    input_profiles,
    mark_dynamic,
    tensorrt_inputs,
    trace_sizes,
    unexportable_reason,
    warmup_samples,
)


@pytest.fixture(scope="module")
def graph(encoder, make_graph, make_samples):
    return make_graph(encoder, make_samples())


def test_one_dim_per_name_shared_across_inputs(graph, encoder) -> None:
    dims = export_dims(graph)
    assert set(dims) == {"batch", "d0"}
    shapes = dynamic_shapes(graph, dims, encoder.forward)
    assert set(shapes) == {"x", "mask", "bias"}
    assert shapes["x"][0] is shapes["mask"][0] is dims["batch"]
    assert shapes["x"][1] is shapes["mask"][1] is dims["d0"]
    assert shapes["bias"] is None, "a static tensor gets no dims"


def test_exported_program_covers_the_graph_ranges(graph, encoder, make_samples) -> None:
    program = export_program(encoder, graph, make_samples()[0])
    bounds = sorted((int(r.lower), int(r.upper)) for r in program.range_constraints.values())
    assert bounds == [(2, 3), (5, 7)]
    exported = program.module()
    for b, s in [(2, 5), (3, 7), (3, 6)]:
        sample = make_samples(((b, s),))[0]
        want = encoder(*sample.args, **sample.kwargs)
        got = exported(*sample.args, **sample.kwargs)
        assert_matches_eager(got["hidden"], want["hidden"])
    x, mask = torch.randn(2, 6, 4), torch.ones(2, 5)
    with pytest.raises(AssertionError):  # the shared dim makes the program guard equal sequence lengths
        exported(x, mask, bias=torch.zeros(8))


def test_declared_dims_keep_their_names_and_bounds(encoder, make_samples, make_graph) -> None:
    seq = DynamicDim(min=1, max=16, name="seq len")
    graph = make_graph(encoder, make_samples(), dynamic_shapes={"x": {1: seq}, "mask": {1: seq}})
    assert export_dim_names(graph)["seq len"].isidentifier()
    program = export_program(encoder, graph, make_samples()[0])
    assert (1, 16) in {(int(r.lower), int(r.upper)) for r in program.range_constraints.values()}
    sample = make_samples(((3, 16),))[0]
    assert_matches_eager(
        program.module()(*sample.args, **sample.kwargs)["pooled"], encoder(*sample.args, **sample.kwargs)["pooled"]
    )


def test_trace_sizes_avoid_the_specialised_sizes(encoder, make_samples, make_graph) -> None:
    graph = make_graph(encoder, make_samples(((1, 5), (1, 6), (4, 6))))
    assert graph.dims["batch"].opt == 1
    assert trace_sizes(graph) == {"batch": 2, "d0": 6}, "batch traced at 2, not its opt 1; d0 at its opt"


def test_a_zero_to_one_range_cannot_be_exported(encoder, make_samples, make_graph) -> None:
    graph = make_graph(encoder, make_samples(((0, 5), (1, 5))))
    assert "batch" in (unexportable_reason(graph) or "")
    assert unexportable_reason(make_graph(encoder, make_samples())) is None


def test_input_profiles_give_min_opt_max_per_tensor(graph) -> None:
    by_path = {p.path: p for p in input_profiles(graph)}
    assert by_path["x"].input_kwargs() == {
        "min_shape": (2, 5, 4),
        "opt_shape": (2, 7, 4),
        "max_shape": (3, 7, 4),
        "dtype": torch.float32,
    }
    assert by_path["mask"].min == (2, 5) and by_path["mask"].max == (3, 7)
    assert by_path["bias"].input_kwargs() == {"shape": (8,), "dtype": torch.float32}


def test_tensorrt_inputs_follow_the_calling_convention(graph) -> None:
    args, kwargs = tensorrt_inputs(graph, dict)
    assert [a["opt_shape"] for a in args] == [(2, 7, 4), (2, 7)]
    assert set(kwargs) == {"bias"} and kwargs["bias"]["shape"] == (8,)


def test_warmup_covers_samples_and_both_extremes(graph, make_samples) -> None:
    samples = make_samples()
    calls = warmup_samples(graph, samples)
    shapes = [tuple(c.args[0].shape[:2]) for c in calls]
    assert shapes == [(2, 7), (2, 5), (3, 7), (2, 7), (2, 5), (3, 7)]
    assert all(c.kwargs["bias"].shape == (8,) for c in calls)


def test_mark_dynamic_leaves_the_recorded_sample_alone(graph, make_samples) -> None:
    sample = make_samples()[1]
    marked = mark_dynamic(graph, sample)
    assert getattr(marked.args[0], "_dynamo_dynamic_indices", set()) == {0, 1}
    assert not getattr(sample.args[0], "_dynamo_dynamic_indices", set())
    assert not getattr(marked.kwargs["bias"], "_dynamo_dynamic_indices", set())
