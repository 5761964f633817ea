"""Optimisation profiles from graph specs: ranges, opt at the most common shape, user profiles."""

from __future__ import annotations

import pytest
import torch

from aitune.errors import ConfigError
from aitune.graph import BatchDim, DynamicDim, Sample
from aitune.testing import TinyMLP, tiny_samples
from aitune_backend_tensorrt.config import TensorRTProfile
from aitune_backend_tensorrt.profiles import (
    ShapeProfile,
    graph_profile,
    resolve_profiles,
    select_profile,
    uncovered,
)


def test_batch_axis_profile_spans_the_recorded_batches_with_opt_at_the_most_common(make_graph):
    module = TinyMLP().eval()
    graph = make_graph(module, tiny_samples((2, 8, 4, 4, 4, 3)), ["x"])
    (profile,) = resolve_profiles(graph, [])
    assert profile.shapes == (((2, 16), (4, 16), (8, 16)),)


def test_shared_sequence_axis_gets_one_range_across_inputs(two_inputs):
    _, _, graph = two_inputs
    profile = graph_profile(graph)
    ids, mask = profile.shapes
    assert ids == ((2, 5), (4, 7), (4, 12))  # batch 2..4 opt 4, sequence 5..12 opt 7 (most common)
    assert mask == ids


def test_declared_dims_bound_the_profile_and_opt_stays_at_the_recorded_mode(make_graph):
    module = TinyMLP().eval()
    samples = tiny_samples((3, 3, 5))
    graph = make_graph(module, samples, ["x"], dynamic_shapes={"x": {0: BatchDim(min=1, max=64)}})
    (profile,) = resolve_profiles(graph, [])
    assert profile.shapes == (((1, 16), (3, 16), (64, 16)),)

    conv_samples = [Sample((torch.randn(1, 3, h, 8),)) for h in (8, 16, 16)]
    conv = torch.nn.Conv2d(3, 2, 3).eval()
    graph = make_graph(conv, conv_samples, ["x"], dynamic_shapes={"x": {2: DynamicDim(min=4, max=32)}})
    assert graph_profile(graph).shapes == (((1, 3, 4, 8), (1, 3, 16, 8), (1, 3, 32, 8)),)


def test_static_graph_has_min_opt_max_equal(make_graph):
    module = TinyMLP().eval()
    graph = make_graph(module, tiny_samples((4, 4)), ["x"])
    assert graph_profile(graph).shapes == (((4, 16), (4, 16), (4, 16)),)


def test_user_profiles_cover_short_and_long_sequences_and_fill_shared_dims(two_inputs):
    _, _, graph = two_inputs
    short = TensorRTProfile(shapes={"input_ids": ((1, 1), (4, 8), (4, 8))})
    long = TensorRTProfile(shapes={"input_ids": ((1, 9), (2, 12), (4, 12))})
    profiles = resolve_profiles(graph, [short, long])
    # the mask is not listed: it follows the sequence length input_ids fixes in each profile
    assert profiles[0].shapes[1] == ((1, 1), (4, 8), (4, 8))
    assert profiles[1].shapes[1] == ((1, 9), (2, 12), (4, 12))
    assert select_profile(profiles, [(3, 5), (3, 5)]) == 0
    assert select_profile(profiles, [(2, 12), (2, 12)]) == 1
    assert select_profile(profiles, [(8, 5), (8, 5)]) is None
    assert uncovered(graph, profiles, [[(2, 5), (2, 5)], [(3, 12), (3, 12)]]) is None


def test_tightest_containing_profile_wins_and_ties_go_to_the_first():
    wide = ShapeProfile((((1, 4), (8, 4), (64, 4)),))
    narrow = ShapeProfile((((1, 4), (2, 4), (8, 4)),))
    assert select_profile([wide, narrow], [(4, 4)]) == 1
    assert select_profile([wide, narrow], [(32, 4)]) == 0
    assert select_profile([narrow, narrow], [(4, 4)]) == 0
    assert select_profile([wide], [(4, 4, 1)]) is None  # rank mismatch


def test_profiles_that_leave_a_recorded_shape_uncovered_are_reported(two_inputs):
    _, _, graph = two_inputs
    short = TensorRTProfile(shapes={"input_ids": ((1, 1), (4, 8), (4, 8))})
    profiles = resolve_profiles(graph, [short])
    reason = uncovered(graph, profiles, [[(3, 12), (3, 12)]])
    assert reason is not None and "recorded sample 0" in reason and "input_ids=(3, 12)" in reason


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        ({"tokens": ((1, 1), (1, 1), (1, 1))}, "graph's inputs are"),
        ({"input_ids": ((1,), (2,), (4,))}, "rank 1"),
        ({"input_ids": ((1, 5), (2, 7), (4, 12)), "mask": ((1, 5), (2, 8), (4, 12))}, "same (min, opt, max)"),
    ],
)
def test_user_profiles_that_do_not_fit_the_graph_are_refused(two_inputs, shapes, message):
    _, _, graph = two_inputs
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_profiles(graph, [TensorRTProfile(shapes=shapes)])


def test_a_static_axis_must_stay_static_in_a_user_profile(make_graph):
    graph = make_graph(TinyMLP().eval(), tiny_samples((2, 4)), ["x"])
    with pytest.raises(ConfigError, match=r"axis 1 is static \(16\)"):
        resolve_profiles(graph, [TensorRTProfile(shapes={"x": ((1, 8), (2, 16), (4, 16))})])


def test_profiles_keyed_by_onnx_names_round_trip():
    profile = ShapeProfile((((1, 4), (2, 4), (8, 4)), ((3,), (3,), (3,))))
    data = profile.to_json(["x", "scale"])
    assert data == {"x": [[1, 4], [2, 4], [8, 4]], "scale": [[3], [3], [3]]}
    assert ShapeProfile.from_json(data, ["x", "scale"]) == profile


def test_exported_onnx_inputs_match_the_profile_names_and_dynamic_axes(mlp_export):
    import onnx

    exported, _, graph, _ = mlp_export
    (profile,) = resolve_profiles(graph, [])
    model = onnx.load(str(exported.path), load_external_data=False)
    onnx_inputs = {v.name: v.type.tensor_type.shape.dim for v in model.graph.input}
    assert list(exported.input_names) == ["x"] and set(onnx_inputs) == {"x"}
    (lo, opt, hi), dims = profile.shapes[0], onnx_inputs["x"]
    for axis, dim in enumerate(dims):
        dynamic = bool(dim.dim_param) or not dim.HasField("dim_value")
        assert dynamic == (lo[axis] != hi[axis]), f"axis {axis}: ONNX and profile disagree"
    assert (lo, opt, hi) == ((2, 16), (4, 16), (4, 16))
