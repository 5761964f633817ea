"""Graphs from recorded samples: batch axes, dynamic dims, declared dims and their checks."""

from __future__ import annotations

import pytest
import torch

from aitune.errors import InputError
from aitune.graph import BatchDim, DynamicDim, Sample, assemble, infer_graph, resize


def s(*tensors, **kw):
    return Sample(tuple(tensors), kw)


def test_batch_axis_is_found_from_two_batch_sizes():
    g = infer_graph([s(torch.zeros(2, 5)), s(torch.zeros(8, 5)), s(torch.zeros(8, 5))], ["x"])
    [x] = g.inputs
    assert x.dims == ("batch", None) and x.shape == (8, 5)
    assert (g.batch.min, g.batch.opt, g.batch.max) == (2, 8, 8)


def test_one_batch_size_is_static_unless_batch_sizes_are_given():
    assert infer_graph([s(torch.zeros(4, 3))], ["x"]).dims == {}
    g = infer_graph([s(torch.zeros(4, 3))], ["x"], batch_sizes=[1, 16])
    assert (g.batch.min, g.batch.opt, g.batch.max) == (1, 4, 16)


def test_axes_varying_together_share_one_dim():
    samples = [
        s(torch.zeros(2, 7, dtype=torch.long), mask=torch.ones(2, 7)),
        s(torch.zeros(2, 12, dtype=torch.long), mask=torch.ones(2, 12)),
    ]
    g = infer_graph(samples, ["ids"])
    ids, mask = g.inputs
    assert ids.path == "ids" and mask.path == "mask"
    assert ids.dims == (None, "d0") and mask.dims == (None, "d0")
    assert (g.dims["d0"].min, g.dims["d0"].max) == (7, 12)


def test_nested_inputs_are_named_by_parameter_and_path():
    g = infer_graph([s({"a": torch.zeros(1), "b": (torch.zeros(2), 3)})], ["batch_dict"])
    assert [t.path for t in g.inputs] == ["batch_dict.a", "batch_dict.b.0"]


def test_declared_dims_set_bounds_and_are_checked():
    samples = [s(torch.zeros(2, 10)), s(torch.zeros(2, 20))]
    g = infer_graph(samples, ["x"], {"x": {0: BatchDim(min=1, max=64), 1: DynamicDim(min=4, max=128, name="seq")}})
    assert g.inputs[0].dims == ("batch", "seq")
    assert (g.dims["batch"].min, g.dims["batch"].max) == (1, 64)
    assert (g.dims["seq"].min, g.dims["seq"].max) == (4, 128)
    with pytest.raises(InputError, match=r"'x' axis 1 took the value 20 .* bounds \[4, 16\] of 'd0'"):
        infer_graph(samples, ["x"], {"x": {1: DynamicDim(min=4, max=16)}})
    with pytest.raises(InputError, match="names the input 'y'"):
        infer_graph(samples, ["x"], {"y": {0: BatchDim()}})
    with pytest.raises(InputError, match="axis 5"):
        infer_graph(samples, ["x"], {"x": {5: DynamicDim()}})


def test_bad_declarations_are_refused():
    with pytest.raises(InputError, match="min is larger than max"):
        DynamicDim(min=5, max=2)
    with pytest.raises(InputError, match="opt lies outside"):
        DynamicDim(min=1, opt=9, max=4)


def test_aitune_positional_dims_and_the_keyword_form_are_the_same_dims():
    assert DynamicDim("seq", 1, 512) == DynamicDim(name="seq", min=1, max=512)
    assert DynamicDim("seq", 1, 512, 64).opt == 64
    assert BatchDim("batch", 1, 8) == BatchDim(name="batch", min=1, max=8)
    assert BatchDim(max=64).max == 64 and BatchDim(max=64).name is None
    with pytest.raises(InputError, match=r"first argument is the name.*DynamicDim\(min=1, max=512\)"):
        DynamicDim(1, 512)
    with pytest.raises(InputError, match="use BatchDim"):
        DynamicDim("batch", 1, 8)


def test_per_parameter_tuples_declare_every_axis():
    samples = [s(torch.zeros(1, 3, 10), mask=torch.ones(1, 10)), s(torch.zeros(1, 3, 20), mask=torch.ones(1, 20))]
    shapes = {
        "x": (BatchDim("batch", 1, 8), 3, DynamicDim("seq", 1, 512)),
        "mask": (BatchDim("batch", 1, 8), DynamicDim("seq", 1, 512)),
    }
    g = infer_graph(samples, ["x"], shapes)
    x, mask = g.inputs
    assert x.dims == ("batch", None, "seq") and mask.dims == ("batch", "seq")
    assert (g.dims["batch"].min, g.dims["batch"].max) == (1, 8)
    assert (g.dims["seq"].min, g.dims["seq"].max) == (1, 512)
    # the tuple and the {axis: dim} mapping are two spellings of one declaration
    same = infer_graph(
        samples, ["x"], {"x": {0: BatchDim("batch", 1, 8), 2: DynamicDim("seq", 1, 512)}, "mask": shapes["mask"]}
    )
    assert same == g


def test_per_parameter_tuples_are_checked_against_the_recorded_inputs():
    samples = [s(torch.zeros(1, 3, 10))]
    with pytest.raises(InputError, match=r"'x' axis 1 is 4, but a recorded sample has 3"):
        infer_graph(samples, ["x"], {"x": (BatchDim("b", 1, 8), 4, DynamicDim("seq", 1, 64))})
    with pytest.raises(InputError, match="has 2 entries, but 'x' has rank 3"):
        infer_graph(samples, ["x"], {"x": (BatchDim("b", 1, 8), 3)})
    with pytest.raises(InputError, match=r"dynamic_shapes\['x'\]\[1\] must be an int, a DynamicDim or a BatchDim"):
        infer_graph(samples, ["x"], {"x": (1, "three", 10)})
    with pytest.raises(InputError, match="one batch dimension"):
        infer_graph(
            [s(torch.zeros(1, 3), torch.zeros(1, 3))], ["x", "y"], {"x": (BatchDim("a"), 3), "y": (BatchDim("b"), 3)}
        )


def test_mismatch_explains_why_a_call_does_not_fit():
    g = infer_graph([s(torch.zeros(2, 5)), s(torch.zeros(4, 5))], ["x"])
    assert g.mismatch([torch.zeros(3, 5)]) is None
    assert "axis 0 (batch) is 9, tuned for 2..4" in g.mismatch([torch.zeros(9, 5)])
    assert "axis 1 is 6, tuned for the static size 5" in g.mismatch([torch.zeros(3, 6)])
    assert "rank 3" in g.mismatch([torch.zeros(3, 5, 1)])


def test_resize_reuses_real_rows():
    g = infer_graph([s(torch.arange(3.0).reshape(3, 1)), s(torch.zeros(1, 1))], ["x"])
    big = resize(g, s(torch.arange(3.0).reshape(3, 1)), {"batch": 7})
    assert big.args[0].flatten().tolist() == [0, 1, 2, 0, 1, 2, 0]


def test_assemble_forms_a_batch_by_concatenating_recorded_samples():
    samples = [s(torch.full((1, 2), float(i)), torch.tensor(7.0)) for i in range(3)]
    g = infer_graph(samples, ["x", "scale"], batch_sizes=[1, 16])
    batch = assemble(g, samples, {"batch": 8})
    x, scale = batch.args
    assert x.shape == (8, 2) and x[:, 0].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert scale.shape == ()  # inputs without a batch axis come from the first sample
    one = assemble(g, samples, {"batch": 1})
    assert one.args[0].tolist() == [[0.0, 0.0]]


def test_key_is_stable_and_structure_sensitive():
    a = infer_graph([s(torch.zeros(2, 5))], ["x"])
    b = infer_graph([s(torch.ones(2, 5))], ["x"])
    c = infer_graph([s(torch.zeros(2, 5, dtype=torch.float64))], ["x"])
    assert a.key == b.key != c.key


def test_unsupported_leaf_is_named():
    with pytest.raises(InputError, match="unsupported value of type object at .*1"):
        infer_graph([s(torch.zeros(1), object())], ["x", "y"])


def test_differences_name_the_keyword_the_value_and_the_tensor_that_differ():
    from aitune import tree

    g = infer_graph([s(torch.zeros(2, 5), mode="fast", mask=None)], ["x"])

    def call(*args, **kwargs):
        leaves, structure = tree.flatten((args, kwargs))
        return g.differences(structure, leaves)

    assert call(torch.zeros(2, 5), mode="fast", mask=None) == []
    assert call(torch.zeros(2, 5), mode="slow", mask=None) == ["mode is 'slow', tuned with 'fast'"]
    assert call(torch.zeros(2, 5), mode="fast", mask=torch.ones(2, 5)) == ["mask is a tensor, tuned with None"]
    assert call(torch.zeros(2, 5), mode="fast") == ["the keyword mask is missing, tuned calls passed None"]
    assert call(torch.zeros(2, 5, dtype=torch.half), mode="fast", mask=None) == ["x is float16, tuned with float32"]
    assert call(torch.zeros(2, 5), mode="fast", mask=None, extra=3) == [
        "the keyword extra (3) was never passed while tuning"
    ]


def test_differences_name_a_cache_length_other_than_the_tuned_one():
    transformers = pytest.importorskip("transformers")
    from aitune import tree

    config = transformers.LlamaConfig(
        hidden_size=16, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1, intermediate_size=32
    )

    def cache(length):
        c = transformers.StaticCache(config=config, max_cache_len=length)
        c.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), 0, {"cache_position": torch.tensor([0])})
        return c

    g = infer_graph([s(torch.zeros(1, 1), past_key_values=cache(8))], ["x"])
    leaves, structure = tree.flatten(((torch.zeros(1, 1),), {"past_key_values": cache(16)}))
    assert "past_key_values.layers.0.max_cache_len is 16, tuned with 8" in g.differences(structure, leaves)


def test_axes_of_one_input_that_happen_to_be_equal_stay_apart():
    g = infer_graph(
        [s(torch.zeros(1, 3, 8, 8), torch.zeros(1, 8, 8)), s(torch.zeros(1, 3, 12, 12), torch.zeros(1, 12, 12))],
        ["image", "mask"],
    )
    image, mask = g.inputs
    assert image.dims[2:] == mask.dims[1:], "height with height, width with width across inputs"
    assert image.dims[2] != image.dims[3], "a square image keeps height and width apart"
    assert g.mismatch([torch.zeros(1, 3, 8, 12), torch.zeros(1, 8, 12)]) is None


def test_a_square_mask_beside_states_of_that_length_is_one_length():
    """BERT's encoder: a [batch, 1, seq, seq] mask beside [batch, seq, hidden] states. The states say
    both mask axes are the sequence length: one dim, so no size is ever made where they differ."""
    samples = [s(torch.zeros(1, n, 4), torch.zeros(1, 1, n, n)) for n in (8, 16)]
    g = infer_graph(samples, ["hidden_states", "attention_mask"])
    states, mask = g.inputs
    assert mask.dims[2] == mask.dims[3] == states.dims[1], (states.dims, mask.dims)
    assert len(g.dims) == 1
