"""Calls replayed the way they were made, and outputs rebuilt in their own types.

Real models (transformers, diffusers) call modules by keyword through decorators that read their
keyword arguments, pass enums and flags, and return NamedTuples, dataclasses and ``ModelOutput``s;
a tuned module must take the same calls and return the same types, also after save and load.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import json
import sys
import warnings
from typing import NamedTuple

import pytest
import torch
import torch.utils._pytree as pytree
from aitune_testkit.doubles import FlatBackend, SlowModule

import aitune.torch as ait
from aitune import tree
from aitune.engine.recording import Canonicalizer
from aitune.errors import ArtifactError, InputError, UnsupportedValueError
from aitune.testing import assert_matches_eager
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5), extend_s=0.0
)


class Pair(NamedTuple):
    y: torch.Tensor
    skipped: torch.Tensor | None


@dataclasses.dataclass
class Out:
    y: torch.Tensor
    label: str = "y"
    hidden: tuple[torch.Tensor, ...] | None = None


class Mode(enum.Enum):
    FAST = "fast"
    EXACT = "exact"


class Box:
    """A pytree node with a JSON context (as libraries register their own containers)."""

    def __init__(self, items: list[torch.Tensor], scale: float) -> None:
        self.items, self.scale = items, scale


pytree.register_pytree_node(
    Box,
    lambda b: (b.items, b.scale),
    lambda items, scale: Box(list(items), scale),
    serialized_type_name=f"{__name__}.Box",
)


def _flat() -> ait.TuneStrategy:
    return ait.OneBackendStrategy(FlatBackend(), profiling_config=QUICK).enable_performance_validation(False)


def test_structures_round_trip_through_json_in_their_own_types():
    a, b, c, d, e = (torch.randn(2) for _ in range(5))
    value = {
        "pair": Pair(a, None),
        "out": Out(b, hidden=(c,)),
        "ordered": collections.OrderedDict(z=d),
        "mode": Mode.EXACT,
        "box": Box([e], 0.5),
    }
    leaves, structure = tree.flatten(value)
    rebuilt = tree.unflatten(json.loads(json.dumps(structure)), leaves)
    assert type(rebuilt["pair"]) is Pair and rebuilt["pair"].y is a and rebuilt["pair"].skipped is None
    assert type(rebuilt["out"]) is Out and rebuilt["out"].label == "y" and rebuilt["out"].hidden[0] is c
    assert type(rebuilt["ordered"]) is collections.OrderedDict and rebuilt["ordered"]["z"] is d
    assert rebuilt["mode"] is Mode.EXACT
    assert type(rebuilt["box"]) is Box and rebuilt["box"].items[0] is e and rebuilt["box"].scale == 0.5
    assert tree.leaf_paths(structure) == ["pair.y", "out.y", "out.hidden.0", "ordered.z", "box.0"]


def test_types_that_cannot_be_rebuilt_are_refused_with_the_reason():
    @dataclasses.dataclass
    class Local:
        y: torch.Tensor

    with pytest.raises(UnsupportedValueError, match="Local at output cannot be imported back.*module level"):
        tree.flatten(Local(torch.ones(1)), "output")

    @dataclasses.dataclass
    class Derived:
        y: torch.Tensor
        norm: float = dataclasses.field(init=False, default=0.0)

    with pytest.raises(UnsupportedValueError, match="fields outside __init__"):
        tree.flatten(Derived(torch.ones(1)), "output")
    with pytest.raises(UnsupportedValueError, match="unsupported value of type function at cb"):
        tree.flatten(lambda: None, "cb")
    with pytest.raises(InputError, match="'nowhere.mod:Out' .* is not loaded in this process"):
        tree.check_types({"kind": "dataclass", "type": "nowhere.mod:Out", "keys": [], "items": []})
    with pytest.raises(InputError, match="not one; the structure is corrupt"):
        tree.check_types({"kind": "enum", "type": f"{__name__}:Out", "name": "X"})


def test_a_call_is_rearranged_only_as_far_as_it_stays_the_same_call():
    def forward(x, mask=None, *, scale=1.0, **extra):
        pass

    c = Canonicalizer(forward)
    x, m = torch.ones(1), torch.zeros(1)
    assert c.arrange((x,), {"mask": m}, (2, ())) == ((x, m), {})
    assert c.arrange((x, m), {}, (1, ("mask",))) == ((x,), {"mask": m})
    assert c.arrange((x,), {"mask": None, "scale": 1.0}, (1, ())) == ((x,), {})
    assert c.arrange((), {"x": x, "other": 3}, (1, ("other",))) == ((x,), {"other": 3})
    with pytest.raises(TypeError, match="scale=2.0 is not its default"):
        c.arrange((x,), {"scale": 2.0}, (1, ()))
    with pytest.raises(TypeError, match="does not have"):
        c.arrange((x,), {}, (1, ("other",)))


def fills_use_cache(fn):
    """Like transformers' forward decorators: fills a keyword argument the caller left out."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if kwargs.get("use_cache") is None:
            kwargs["use_cache"] = False
        return fn(self, *args, **kwargs)

    return wrapper


class Decoder(SlowModule):
    @fills_use_cache
    def forward(self, x, mask=None, use_cache=None):
        assert use_cache is False
        return Out(super().forward(x, mask), label="decoded")


def test_keyword_calls_through_a_decorator_are_replayed_as_made(toy_backends):
    model = ait.Module(Decoder(), "decoder", strategy=_flat())
    x = torch.randn(2, 8)
    report = ait.tune(model, [{"x": x, "use_cache": None}, {"x": torch.randn(4, 8), "use_cache": None}])
    assert report.modules[0].status == "tuned", report.modules[0].error
    ((_, backend),) = model.tuned_graphs
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("error")  # every form of the call reaches the backend: no eager fallback
        before = backend.calls
        for out in (model(x=x, use_cache=None), model(x, use_cache=None), model(x, None, None), model(x)):
            assert type(out) is Out and out.label == "decoded"
            assert_matches_eager(out.y, model.module(x).y)
        assert backend.calls == before + 4


class Heads(SlowModule):
    def forward(self, x, mode: Mode = Mode.FAST, with_pair: bool = False):
        y = super().forward(x)
        if with_pair:
            return Pair(y, None)
        return collections.OrderedDict(y=y if mode is Mode.FAST else y * 2)


def test_constants_split_graphs_and_types_survive_save_and_load(toy_backends, tmp_path):
    model = ait.Module(Heads(), "heads", strategy=_flat())
    calls = [
        ((torch.randn(2, 8),), {}),
        ((torch.randn(2, 8), Mode.EXACT), {}),
        ((torch.randn(2, 8),), {"with_pair": True}),
    ]
    report = ait.tune(model, calls)
    assert [g.decision for g in report.modules[0].graphs] == ["toy_flat"] * 3, "enum and bool values are graph keys"
    ait.save(model, tmp_path / "heads.ait")
    fresh = ait.load(ait.Module(Heads(), "heads"), tmp_path / "heads.ait")
    x = torch.randn(2, 8)
    for m in (model, fresh):
        assert type(m(x)) is collections.OrderedDict
        assert_matches_eager(m(x, Mode.EXACT)["y"], 2 * m.module(x)["y"])
        pair = m(x, with_pair=True)
        assert type(pair) is Pair and pair.skipped is None


def test_an_output_type_missing_where_the_artifact_loads_is_refused_or_eager(toy_backends, tmp_path, monkeypatch):
    model = ait.Module(Heads(), "heads", strategy=_flat())
    ait.tune(model, [((torch.randn(2, 8),), {"with_pair": True})])
    path = ait.save(model, tmp_path / "heads.ait")
    monkeypatch.delattr(sys.modules[__name__], "Pair")  # as if the defining package were not installed
    tree._checked.cache_clear()
    tree.resolve.cache_clear()
    try:
        with pytest.raises(ArtifactError, match="Pair' named in the structure does not exist"):
            ait.load(ait.Module(Heads(), "heads"), path)
        with pytest.warns(RuntimeWarning, match="cannot be rebuilt in their own type.*runs eager for that graph"):
            fresh = ait.load(ait.Module(Heads(), "heads"), path, fallback="eager")
        assert fresh.state == "passthrough"
    finally:
        tree._checked.cache_clear()
        tree.resolve.cache_clear()


def test_call_leaves_reads_a_call_of_tensors_in_the_structures_order_and_flattens_any_other():
    a, b, c = torch.ones(1), torch.zeros(2), torch.ones(3)
    by_keyword = tree.CallLeaves(tree.flatten(((), {"ids": a, "mask": b}))[1])
    assert by_keyword.keys == ("ids", "mask") and by_keyword.n_args == 0
    assert list(by_keyword((), {"mask": b, "ids": a})) == [a, b], "the graph's order, whatever the call's"
    assert list(by_keyword((), {"ids": a, "other": b})) == [a, b], "other keywords: flattened as they come"
    mixed = tree.CallLeaves(tree.flatten(((a,), {"mask": b}))[1])
    assert list(mixed((c,), {"mask": b})) == [c, b]
    positional = tree.CallLeaves(tree.flatten(((a, b), {}))[1])
    assert positional((a, b), {}) == (a, b)
    assert list(positional((a, b, c), {})) == [a, b, c], "another count: flattened"
    nested = tree.CallLeaves(tree.flatten(((a, [b, c]), {}))[1])
    assert nested.n_args is None and list(nested((a, [b, c]), {})) == [a, b, c]
    for broken in ({}, {"kind": "tuple", "items": [1, 2]}, {"kind": "tuple", "items": []}, {"kind": "dict"}):
        assert tree.CallLeaves(broken).n_args is None  # a structure read from a file may be anything
