"""Inputs a module updates in place (a KV cache's tensors): the declared contract.

Recording keeps each call's inputs as they were before it ran; only a backend that declares
``mutates_inputs`` is built for such a graph (the others are skipped with the reason); validation
compares what the candidate left in those inputs with what eager left; profiling restores them
before every timed call.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune.engine import recording
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5), extend_s=0.0
)


class Accumulate(torch.nn.Module):
    """Adds each step's output into ``total`` in place, as a decode step writes its cache."""

    def __init__(self) -> None:
        super().__init__()
        self.step = SlowModule(features=4, delay_s=0.005)  # a toy backend runs it faster

    def forward(self, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        y = self.step(x)
        total.add_(y.sum(0))
        return y * total


class InPlaceToy(ToyBackend):
    """Runs a copy of the module on the inputs it is given: their updates happen, as in eager."""

    name = "toy_inplace"
    mutates_inputs = True


class ForgetfulToy(ToyBackend):
    """Says it supports input mutation, but runs on copies: the caller's inputs never change."""

    name = "toy_forgetful"
    mutates_inputs = True

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        return super().infer(*copy.deepcopy(args), **copy.deepcopy(kwargs))


def steps(module: torch.nn.Module, n: int = 4) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(1)
    total = torch.zeros(4)
    outs = [module(torch.randn(2, 4), total) for _ in range(n)]
    return outs, total


def tuned(*backends: ToyBackend) -> tuple[ait.Module, Any]:
    torch.manual_seed(0)
    module = ait.Module(Accumulate().eval(), "acc", strategy=ait.MaxThroughputStrategy(list(backends), QUICK))
    report = ait.tune(lambda item: steps(module), [0])
    return module, report


def candidates(report: Any) -> dict[str, Any]:
    return {c.backend: c for g in report.modules[0].graphs for c in g.candidates}


def test_a_backend_without_input_mutation_is_skipped_with_the_reason() -> None:
    _, report = tuned(ToyBackend(ToyConfig(speed=0.1)), InPlaceToy(ToyConfig(speed=0.1)))
    (graph,) = report.modules[0].graphs
    assert graph.graph["mutated"] == ["total"]
    found = candidates(report)
    assert found["toy"].status == "failed" and found["toy"].stage == "availability"
    assert "updates inputs in place (total" in found["toy"].reason
    assert found["toy_inplace"].status != "failed", found["toy_inplace"].reason


def test_the_tuned_module_updates_the_inputs_as_eager_does() -> None:
    module, report = tuned(InPlaceToy(ToyConfig(speed=0.1)))
    assert report.modules[0].graphs[0].decision == "toy_inplace"
    reference = Accumulate().eval()
    reference.load_state_dict(module.module.state_dict())
    with torch.no_grad():
        want, want_total = steps(reference, 6)  # more steps than were recorded: the state keeps moving
        got, got_total = steps(module, 6)
    assert torch.allclose(got_total, want_total, atol=1e-5, rtol=1e-4)
    for a, e in zip(got, want):
        assert torch.allclose(a, e, atol=1e-5, rtol=1e-4)


def test_a_candidate_that_drops_the_update_fails_validation() -> None:
    _, report = tuned(ForgetfulToy(ToyConfig(speed=0.1)))
    found = candidates(report)["toy_forgetful"]
    assert found.status == "failed" and found.stage == "validate"
    assert "after the call" in found.reason
    assert report.modules[0].graphs[0].decision == "torch_eager"


def test_the_samples_hold_the_inputs_from_before_each_call() -> None:
    """Validation and profiling rerun recorded calls: from the state after a call, a decode step
    would run one step too far (past its cache's end) and be compared on the wrong state."""
    module = ait.Module(Accumulate().eval(), "acc")
    torch.manual_seed(1)
    total = torch.zeros(4)
    before = []
    with torch.no_grad(), recording.recording(max_samples=8) as session:
        for _ in range(3):
            before.append(total.clone())
            module(torch.randn(2, 4), total)
    (graph,) = session.modules[id(module)].graphs.values()
    assert graph.mutated == {1} and len(graph.samples) == 3
    for sample, expected in zip(graph.samples, before):
        assert torch.equal(sample.args[1], expected)


def test_a_cache_structure_from_a_file_sets_only_data() -> None:
    """A crafted structure can name a cache type, but its attributes are JSON scalars, devices and
    layer flags only: anything else is refused before an object is made."""
    pytest.importorskip("transformers")
    import transformers.cache_utils  # noqa: F401  (the type must be loaded: files never import)

    from aitune import tree
    from aitune.errors import InputError

    node = {
        "kind": "state",
        "type": "transformers.cache_utils:EncoderDecoderCache",
        "attrs": {"is_updated": {"flags": {"0": True}}},
        "keys": [],
        "items": [],
    }
    tree.check_types(node)
    rebuilt = tree.unflatten(node, [])
    assert type(rebuilt).__name__ == "EncoderDecoderCache" and rebuilt.is_updated == {0: True}
    for bad in ({"flags": {"zero": True}}, {"callable": "os:system"}, {"flags": {"0": "yes"}}):
        with pytest.raises(InputError):
            tree.check_types({**node, "attrs": {"is_updated": bad}})
    with pytest.raises(InputError, match="not one"):
        tree.check_types({**node, "type": "collections:OrderedDict"})


def test_a_cache_structure_from_a_file_cannot_hide_a_method_or_name_the_meta_device() -> None:
    """An attribute from a file that would shadow a method (``get_seq_length``) or a dunder, a child
    stored under any other name than a cache keeps its children at, and the ``meta`` device are refused."""
    pytest.importorskip("transformers")
    import transformers.cache_utils  # noqa: F401  (the type must be loaded: files never import)

    from aitune import tree
    from aitune.errors import InputError

    node = {
        "kind": "state",
        "type": "transformers.cache_utils:EncoderDecoderCache",
        "attrs": {},
        "keys": [],
        "items": [],
    }
    const = {"kind": "const", "value": 1}
    hostile = [
        {**node, "attrs": {"get_seq_length": 3}},
        {**node, "attrs": {"__class__": "x"}},
        {**node, "attrs": {"device": {"device": "meta"}}},
        {**node, "keys": ["get_seq_length"], "items": [const]},
        {**node, "keys": ["update"], "items": [const]},
    ]
    for bad in hostile:
        with pytest.raises(InputError):
            tree.check_types(bad)
        with pytest.raises(InputError):
            tree.unflatten(bad, [])
    layer = {"kind": "state", "type": "transformers.cache_utils:StaticLayer", "keys": [], "items": []}
    rebuilt = tree.unflatten({**layer, "attrs": {"is_sliding": False, "device": {"device": "cpu"}}}, [])
    assert rebuilt.is_sliding is False and rebuilt.device == torch.device("cpu"), "plain class values may be set"


def test_a_cache_structure_from_a_file_holds_static_layers_only() -> None:
    """A ``StaticCache`` whose file names a ``DynamicLayer`` (a layer that grows, which no payload can
    hold) is refused before anything is made, as :func:`aitune.state.describe` refuses it from a call."""
    pytest.importorskip("transformers")
    import transformers.cache_utils  # noqa: F401  (the type must be loaded: files never import)

    from aitune import tree
    from aitune.errors import InputError

    def cache(layer_type: str) -> dict:
        layer = {
            "kind": "state",
            "type": f"transformers.cache_utils:{layer_type}",
            "attrs": {},
            "keys": [],
            "items": [],
        }
        layers = {"kind": "list", "items": [layer]}
        return {
            "kind": "state",
            "type": "transformers.cache_utils:StaticCache",
            "attrs": {},
            "keys": ["layers"],
            "items": [layers],
        }

    tree.check_types(cache("StaticLayer"))
    assert type(tree.unflatten(cache("StaticLayer"), []).layers[0]).__name__ == "StaticLayer"
    for layer_type in ("DynamicLayer", "DynamicSlidingWindowLayer"):
        with pytest.raises(InputError, match=f"a cache layer is a {layer_type}"):
            tree.check_types(cache(layer_type))
        with pytest.raises(InputError, match=f"a cache layer is a {layer_type}"):
            tree.unflatten(cache(layer_type), [])


def test_a_sliding_window_step_counter_is_data_not_structure() -> None:
    """A sliding-window layer counts its tokens in a Python int that grows every step: it is a 0-d
    tensor leaf, so every decode step has one key and one structure, and each sample keeps its value."""
    transformers = pytest.importorskip("transformers")
    from aitune import tree
    from aitune.graph import Sample, infer_graph

    config = transformers.MistralConfig(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, sliding_window=3
    )
    cache = transformers.StaticCache(config=config, max_cache_len=8)
    (layer,) = cache.layers
    assert type(layer).__name__ == "StaticSlidingWindowLayer"
    keys, samples = [], []
    for _ in range(2):
        cache.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), 0)
        keys.append(tree.call_key(cache, []))
        samples.append(Sample((copy.deepcopy(cache),)))
    assert [s.args[0].layers[0].cumulative_length_int for s in samples] == [1, 2]
    assert keys[0] == keys[1], "the counter's value is not part of the key"
    (leaves0, structure0), (leaves1, structure1) = (tree.flatten(s.args[0]) for s in samples)
    assert structure0 == structure1
    assert [int(t) for t in leaves0 if t.dim() == 0 and t.dtype == torch.int64][-1] == 1
    rebuilt = tree.unflatten(structure1, leaves1)
    assert type(rebuilt.layers[0].cumulative_length_int) is int and rebuilt.layers[0].cumulative_length_int == 2
    graph = infer_graph(samples, ["cache"])
    assert graph.counters == ("cache.layers.0.cumulative_length_int",)
    assert graph.key == infer_graph(samples[:1], ["cache"]).key


def test_profiling_sets_a_step_counter_back_before_every_timed_call() -> None:
    """A timed call must start from the recorded state: the counter too, not only the tensors, or
    a sliding window's decode step is timed further and further past the step recorded."""
    transformers = pytest.importorskip("transformers")
    from types import SimpleNamespace

    from aitune.engine.graph_tuning.runners import runner
    from aitune.graph import Sample

    config = transformers.MistralConfig(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, sliding_window=3
    )
    cache = transformers.StaticCache(config=config, max_cache_len=8)
    cache.update(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), 0)
    seen = []

    def step(cache: Any) -> None:
        seen.append(cache.layers[0].cumulative_length_int)
        cache.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), 0)

    run = runner(SimpleNamespace(infer=step), [Sample((copy.deepcopy(cache),))], restore=True)
    for _ in range(3):
        run.prepare()
        run()
    assert seen == [2, 2, 2]
