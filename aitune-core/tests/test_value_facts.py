"""What values each input took while tuning (``ValueFacts``): recorded, saved, bounded when read, and
the inputs drawn from them for ``ait.load``'s check, whose comparison is strict about NaN."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aitune.artifact.bounds import graph_problem
from aitune.backend import Tolerance
from aitune.converter import structure, unstructure
from aitune.engine.recording import Canonicalizer, Recording
from aitune.errors import InputError
from aitune.graph import DimRange, DynamicDim, GraphSpec, Sample, TensorSpec, ValueFacts, draw, infer_graph
from aitune.validation import LOAD_CHECK_CASES, check_loaded


def test_tune_records_each_inputs_range_mask_and_finiteness() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    samples = [
        Sample((torch.tensor([[5, 9, 7], [6, 6, 6]]), mask, torch.tensor([0.0, float("inf")]), torch.tensor([True]))),
        Sample((torch.tensor([[3, 4, 4], [4, 4, 4]]), mask, torch.tensor([1.0, 2.0]), torch.tensor([True]))),
    ]
    facts = [spec.values for spec in infer_graph(samples, ["ids", "mask", "x", "flag"]).inputs]
    assert facts == [
        ValueFacts(low=3, high=9),
        ValueFacts(low=0, high=1),
        ValueFacts(finite=False),
        ValueFacts(low=1, high=1),
    ]
    assert facts[1] is not None and facts[1].mask
    assert facts[3] is not None and not facts[3].mask  # only True seen: drawn as seen, never False


def test_every_recorded_call_counts_not_only_the_samples_kept() -> None:
    class Wrapper:
        canonicalizer = Canonicalizer(lambda ids: ids)

    recording: Recording[Any] = Recording(max_samples=1)
    wrapper = Wrapper()
    for low in (10, 0, 50):
        ids = torch.arange(low, low + 4).reshape(1, 4)
        recording.record(wrapper, (ids,), {}, ids.float())
    (graph,) = recording.modules[id(wrapper)].graphs.values()
    assert len(graph.samples) == 1
    assert graph.values == [ValueFacts(low=0, high=53)]
    spec = infer_graph(graph.samples, ["ids"], facts=graph.values).inputs[0]
    assert spec.values == ValueFacts(low=0, high=53)
    assert infer_graph(graph.samples, ["ids"]).inputs[0].values == ValueFacts(low=10, high=13)


def test_a_manifest_without_recorded_values_still_reads_and_draws_as_before() -> None:
    graph = infer_graph([Sample((torch.tensor([[1, 2]]), torch.tensor([True])))], ["ids", "flag"])
    data = unstructure(graph)
    assert data["inputs"][0]["values"] == {"low": 1, "high": 2, "finite": True, "rows": None}
    assert structure(data, GraphSpec) == graph
    for spec in data["inputs"]:
        del spec["values"]
    old = structure(data, GraphSpec)
    assert all(spec.values is None for spec in old.inputs)
    ids, flag = old.example().args
    assert ids.eq(0).all() and flag.all()


def test_opt_is_a_positive_size_where_one_was_recorded_and_never_declared_0() -> None:
    samples = [Sample((torch.zeros(1, n),)) for n in (0, 3, 5)]  # an empty call first: the tie went to 0
    assert infer_graph(samples, ["x"]).dims["d0"] == DimRange(0, 3, 5)
    with pytest.raises(InputError, match="opt=0"):
        DynamicDim("seq", 0, 8, opt=0)


def _graph(spec: TensorSpec) -> GraphSpec:
    return GraphSpec(("x",), {}, (spec,), {"batch": DimRange(1, 2, 4)})


@pytest.mark.parametrize(
    "dtype, facts, problem",
    [
        ("int64", ValueFacts(low=0, high=99), None),
        ("int8", ValueFacts(low=-128, high=127), None),
        ("int8", ValueFacts(low=0, high=300), "not a range of torch.int8"),
        ("int64", ValueFacts(low=5, high=1), "not a range"),
        ("int64", ValueFacts(low=-(2**70), high=0), "not a range"),
        ("bool", ValueFacts(low=0, high=2), "not a range of torch.bool"),
        ("int64", ValueFacts(low=3), "one end only"),
        ("float32", ValueFacts(low=0, high=1), "floating input carries an integer value range"),
        ("float32", ValueFacts(finite=False), None),
        ("int64", ValueFacts(low=0, high=99, rows=100), None),
        ("int64", ValueFacts(low=0, high=100, rows=100), "do not index the recorded 100 embedding rows"),
        ("int64", ValueFacts(low=-1, high=5, rows=100), "do not index"),
        ("int64", ValueFacts(low=0, high=5, rows=0), "not a count"),
        ("int64", ValueFacts(low=0, high=5, rows=True), "not a count"),
        ("bool", ValueFacts(low=0, high=1, rows=2), "only integer ids index a table"),
        ("float32", ValueFacts(rows=2), "floating input carries an integer value range"),
    ],
)
def test_recorded_values_read_from_a_file_are_bounded(dtype: str, facts: ValueFacts, problem: str | None) -> None:
    found = graph_problem(_graph(TensorSpec("x", dtype, "cpu", (2, 6), ("batch", None), facts)))
    assert found is None if problem is None else problem in (found or "")


def test_an_output_carrying_recorded_values_is_refused() -> None:
    graph = _graph(TensorSpec("x", "int64", "cpu", (2, 6), ("batch", None), ValueFacts(low=0, high=1)))
    out = TensorSpec("y", "float32", "cpu", (2,), ("batch",), ValueFacts())
    from attrs import evolve

    assert "only inputs do" in (graph_problem(evolve(graph, outputs=(out,))) or "")


def test_integers_sweep_their_range_from_both_ends_and_masks_never_pad_a_whole_row() -> None:
    ids = TensorSpec("ids", "int64", "cpu", (8, 5), ("batch", None), ValueFacts(low=38, high=45))
    swept = draw(ids, (8, 5))
    assert swept[:2, 0].tolist() == [38, 45]  # the ends first
    for position in range(5):  # 8 rows, 8 values: the whole range at every position
        assert sorted(swept[:, position].tolist()) == list(range(38, 46))
    assert torch.equal(draw(ids, (2, 5), row=3), swept[3:5])  # a later call sweeps on from its first row
    shuffled = draw(ids, (64, 5), generator=torch.Generator().manual_seed(0), shuffled=True)
    assert int(shuffled.min()) >= 38 and int(shuffled.max()) <= 45 and len(shuffled.unique()) == 8

    mask = TensorSpec("mask", "int64", "cpu", (8, 6), ("batch", None), ValueFacts(low=0, high=1))
    for drawn in (draw(mask, (8, 6)), draw(mask, (8, 6), generator=torch.Generator(), shuffled=True)):
        assert drawn[:, 0].eq(1).all()  # no row is all padding
        assert int(drawn.sum()) > drawn.numel() // 2 and int((drawn == 0).sum()) > 0  # mostly ones, some zeros
    huge = TensorSpec("h", "int64", "cpu", (3,), (None,), ValueFacts(low=-(2**63), high=2**63 - 1))
    assert draw(huge, (3,)).tolist()[:2] == [-(2**63), 2**63 - 1]


class _Answers:
    """A payload double: answers what ``fn`` computes from the inputs."""

    name = "double"

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def computes_tf32(self) -> bool:
        return False

    def tolerance(self, dtype: torch.dtype) -> Tolerance | None:
        return None


def _nan_in_column_0(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    y[:, 0] = float("nan")
    return y


def test_the_load_check_is_strict_about_nan_and_runs_min_opt_and_max() -> None:
    graph = infer_graph([Sample((torch.randn(n, 3),)) for n in (1, 2, 2, 4)], ["x"])
    assert graph.dims["batch"] == DimRange(1, 2, 4)
    eager = _nan_in_column_0
    ok = check_loaded(_Answers(_nan_in_column_0), eager, graph)  # type: ignore[arg-type]
    assert ok.reason is None and ok.checked == len(LOAD_CHECK_CASES) and ok.eager_nan
    finite = check_loaded(_Answers(lambda x: x * 2), eager, graph)  # type: ignore[arg-type]
    assert finite.reason is not None and "is not NaN or infinite" in finite.reason

    def off_the_opt_batch(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.shape[0] == graph.dims["batch"].opt else -x * 2

    found = check_loaded(_Answers(off_the_opt_batch), lambda x: x * 2, graph)  # type: ignore[arg-type]
    assert found.reason is not None and found.reason.startswith("min shapes")


def test_a_call_eager_refuses_is_skipped_not_failed() -> None:
    graph = infer_graph([Sample((torch.randn(2, 3),)), Sample((torch.randn(4, 3),))], ["x"])

    def eager(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 4:
            raise ValueError("no batch of 4")
        return x + 1

    result = check_loaded(_Answers(lambda x: x + 1), eager, graph)  # type: ignore[arg-type]
    assert result.reason is None and result.checked == len(LOAD_CHECK_CASES) - 1
    assert result.skipped and "no batch of 4" in result.skipped[0]


def test_a_graph_without_its_values_is_the_same_for_data_of_other_values() -> None:
    """Build-cache and JIT keys need the graph as a build sees it: token ids of another range must
    not make a second tune rebuild."""
    first = infer_graph([Sample((torch.tensor([[1, 2, 3]]),))], ["ids"])
    second = infer_graph([Sample((torch.tensor([[7, 8, 9]]),))], ["ids"])
    assert first != second and first.key == second.key
    assert first.without_values() == second.without_values()
    assert unstructure(first.without_values()) == unstructure(second.without_values())


def test_a_module_compared_unmasked_is_checked_at_its_unmasked_positions_only() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    graph = infer_graph([Sample((torch.randn(2, 4, 3), mask))], ["h", "attention_mask"])

    def eager(h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return h * 2

    def padding_left_as_zero(h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return h * 2 * attention_mask.unsqueeze(-1)

    payload = _Answers(padding_left_as_zero)
    assert check_loaded(payload, eager, graph).reason is not None  # type: ignore[arg-type]
    assert check_loaded(payload, eager, graph, masked_by="attention_mask").reason is None  # type: ignore[arg-type]


def test_the_data_values_change_no_build_cache_key_nor_decision_key(toy_backends) -> None:
    """Token ids from another range are the same graph to a build: a second tune with other data
    reuses the cached build, and the facts still reach the graph it tunes."""
    import aitune.torch as ait
    from aitune.testing.backends import ToyBackend, ToyConfig

    def tuned(high: int) -> Any:
        torch.manual_seed(0)
        strategy = ait.OneBackendStrategy(ToyBackend(ToyConfig())).enable_performance_validation(False)
        model = ait.Module(torch.nn.Embedding(16, 4), "emb", strategy=strategy)
        report = ait.tune(model, [torch.randint(0, high, (2, 3)), torch.randint(0, high, (4, 3))])
        return model, report.modules[0].graphs[0].candidates[0]

    first, built = tuned(6)
    second, again = tuned(16)
    assert not built.from_cache and again.from_cache, "other token ids made another build"
    [(graph, _)] = second.tuned_graphs
    facts = graph.inputs[0].values
    assert facts is not None and facts.low is not None and facts.high is not None and facts.high > 5
    assert first.tuned_graphs[0][0].without_values() == graph.without_values()
