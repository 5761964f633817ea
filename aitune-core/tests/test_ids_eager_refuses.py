"""Integer inputs eager refuses (a token id below 0 or past its embedding's rows): a tuned call whose
values lie outside what its inputs accept runs eager with a warning naming the input and its range
(eager then raises, as it would untuned), raises under ``strict``, and is a client error in serving.

The toy backend stands in for one that would answer such ids (ONNX Runtime's Gather wraps -1 to the
last row; ``tests/test_ids_eager_refuses.py`` runs the real one): here it must never be called.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import aitune.torch as ait
from aitune.engine.dispatch import ValueCheck, observe_routes
from aitune.engine.plan import table_rows
from aitune.engine.recording import GraphRecording
from aitune.errors import UnsupportedCallError
from aitune.graph import GraphSpec, Sample, TensorSpec, ValueFacts
from aitune.testing import assert_matches_eager
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.serving import BatchPlan, BatchRunner, ClientError, input_specs

VOCAB = 100


class Tokens(torch.nn.Module):
    """Token ids through an embedding of 100 rows, a 0/1 mask that only multiplies."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids.view(-1, input_ids.shape[-1])) * attention_mask.unsqueeze(-1)
        return self.head(hidden.mean(dim=1))


def _call(ids: list[list[int]], mask: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    input_ids = torch.tensor(ids)
    return {"input_ids": input_ids, "attention_mask": torch.tensor(mask) if mask else torch.ones_like(input_ids)}


def _tuned(strict: bool = False) -> ait.Module:
    strategy = ait.OneBackendStrategy(ToyBackend(ToyConfig())).enable_performance_validation(False)
    model = ait.Module(Tokens().eval(), "tokens", strategy=strategy, strict=strict)
    g = torch.Generator().manual_seed(0)
    data = [
        ((), _call(torch.randint(10, 40, (b, 6), generator=g).tolist(), [[1] * 5 + [0]] * b)) for b in (2, 4)
    ]  # ids 10..39 only: 40..99 are ids tuning never saw, yet the embedding takes
    ait.tune(model, data)
    assert model.state == "tuned"
    return model


def _backend(model: ait.Module) -> ToyBackend:
    [(_, backend)] = model.tuned_graphs
    assert isinstance(backend, ToyBackend)
    return backend


@pytest.fixture
def model(toy_backends) -> ait.Module:
    return _tuned()


def test_tuning_records_the_rows_of_the_embedding_an_input_indexes(model):
    [(graph, _)] = model.tuned_graphs
    ids, mask = graph.inputs
    assert ids.values is not None and ids.values.rows == VOCAB and ids.values.accepted == (0, VOCAB - 1)
    assert ids.values.low is not None and ids.values.low >= 10 and ids.values.high is not None
    assert ids.values.high < 40
    assert mask.values == ValueFacts(low=0, high=1) and mask.values.accepted is None  # a mask: not checked


def test_ids_tuning_never_saw_but_the_embedding_takes_stay_tuned(model):
    backend = _backend(model)
    before = backend.calls
    call = _call([[0, 45, 99, 12, 3, 7]] * 2)
    with torch.no_grad(), warnings.catch_warnings(), observe_routes() as seen:
        warnings.simplefilter("error")
        assert_matches_eager(model(**call), model.module(**call))
    assert backend.calls == before + 1 and seen[-1].reason is None


@pytest.mark.parametrize("bad", [-1, VOCAB], ids=["below-0", "past-the-rows"])
def test_an_id_the_embedding_refuses_runs_eager_named_and_eager_raises(model, bad):
    backend = _backend(model)
    before = backend.calls
    call = _call([[bad, 11, 12, 13, 14, 15], [11, 12, 13, 14, 15, 16]])
    expected = "tokens: running this call eager: it is outside what was tuned \\(input_ids holds a value outside 0..99"
    with torch.no_grad(), observe_routes() as seen:
        with pytest.warns(RuntimeWarning, match=expected), pytest.raises(IndexError):
            model(**call)
        with warnings.catch_warnings():  # once per input, whatever value it held
            warnings.simplefilter("error")
            with pytest.raises(IndexError):
                model(**_call([[bad - 5 if bad < 0 else bad + 5] * 6] * 2))
    assert backend.calls == before, "the tuned backend was called with an id eager refuses"
    assert seen[0].backend == "torch_eager"
    assert "input_ids holds a value outside 0..99, the rows of the embedding it indexes (tuning saw " in (
        seen[0].reason or ""
    )


def test_a_mask_no_table_indexes_is_not_checked(model):
    backend = _backend(model)
    before = backend.calls
    call = _call([[11, 12, 13, 14, 15, 16]] * 2, [[1, 1, 1, 1, -1, 0]] * 2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_matches_eager(model(**call), model.module(**call))
    assert backend.calls == before + 1


class Shifted(torch.nn.Module):
    """Ids shifted before the table: aitune cannot tell the table's rows, so only values below 0 go eager."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids + 1)


def test_an_input_no_table_indexes_as_it_is_goes_eager_below_0_only(toy_backends):
    strategy = ait.OneBackendStrategy(ToyBackend(ToyConfig())).enable_performance_validation(False)
    model = ait.Module(Shifted().eval(), "shifted", strategy=strategy)
    ait.tune(model, [torch.tensor([[0, 8]]), torch.tensor([[3, 4], [5, 6]])])
    [(graph, backend)] = model.tuned_graphs
    assert graph.inputs[0].values == ValueFacts(low=0, high=8)
    ids = torch.tensor([[-1, 97]])
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match=r"ids holds a value below 0 \(tuning saw 0..8\): a tuned backend"):
            assert_matches_eager(model(ids), model.module(ids))  # eager takes -1 + 1
        before = backend.calls
        model(torch.tensor([[98, 40]]))  # no upper end known: stays tuned
    assert backend.calls == before + 1


def test_strict_raises_aitunes_error_naming_the_input(toy_backends):
    model = _tuned(strict=True)
    with torch.no_grad(), pytest.raises(UnsupportedCallError, match="input_ids holds a value outside 0..99"):
        model(**_call([[-1] * 6] * 2))


def test_the_check_survives_save_and_load(model, tmp_path: Path):
    path = ait.save(model, tmp_path / "tokens.ait")
    loaded = ait.load(ait.Module(Tokens().eval(), "tokens"), path)
    [(graph, backend)] = loaded.tuned_graphs
    assert graph.inputs[0].values is not None and graph.inputs[0].values.rows == VOCAB
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="input_ids holds a value outside 0..99"), pytest.raises(IndexError):
            loaded(**_call([[-1] * 6] * 2))
        before = backend.calls
        loaded(**_call([[98] * 6] * 2))
    assert backend.calls == before + 1


def test_serving_answers_a_client_error_naming_the_input_and_its_range(model):
    runner = BatchRunner(model, BatchPlan.of(model), input_specs(model))
    with pytest.warns(RuntimeWarning, match="input_ids holds a value outside 0..99"):
        good, bad = runner.run([_call([[11] * 6]), _call([[-1] * 6])])
    assert not isinstance(good, ClientError) and good.eager_reasons == ()
    assert isinstance(bad, ClientError)
    assert "input_ids holds a value outside 0..99, the rows of the embedding it indexes" in str(bad)
    assert "IndexError" in str(bad)


def _graph(dtype: str, facts: ValueFacts | None) -> GraphSpec:
    return GraphSpec(("x",), {}, (TensorSpec("x", dtype, "cpu", (2, 3), (None, None), facts),))


@pytest.mark.parametrize(
    ("dtype", "facts", "checked"),
    [
        ("int64", ValueFacts(low=3, high=9), (0, None)),
        ("int64", ValueFacts(low=3, high=9, rows=10), (0, 9)),
        ("int64", ValueFacts(low=-2, high=9), None),  # seen negative: indexes nothing as it is
        ("int64", ValueFacts(), None),  # always empty
        ("int64", None, None),  # an artifact from before values were recorded
        ("uint8", ValueFacts(low=3, high=9), None),  # never below 0, no table known
        ("uint8", ValueFacts(low=3, high=9, rows=10), (0, 9)),
        ("int64", ValueFacts(low=0, high=1), None),  # a mask no table indexes
        ("int64", ValueFacts(low=0, high=1, rows=2), (0, 1)),  # token types
        ("bool", ValueFacts(low=0, high=1), None),
        ("float32", ValueFacts(), None),
    ],
)
def test_which_inputs_are_checked_and_against_what(dtype, facts, checked):
    check = ValueCheck.of(_graph(dtype, facts))
    assert (check.checks[0][1:3] if check is not None else None) == checked


def test_the_check_reads_nothing_of_an_empty_input_and_names_the_input():
    check = ValueCheck.of(_graph("int64", ValueFacts(low=3, high=9, rows=10)))
    assert check is not None
    assert check.outside([torch.zeros(0, 3, dtype=torch.int64)]) is None
    assert check.outside([torch.full((2, 3), 9)]) is None
    assert check.outside([torch.full((2, 3), 10)]) == check.outside([torch.full((2, 3), -7)])
    assert "x holds a value outside 0..9" in (check.outside([torch.full((2, 3), 10)]) or "")


@pytest.mark.parametrize("rows", [1, 100])  # a sentence's ids read as a list; a batch's by two ops
@pytest.mark.parametrize("table", [True, False])  # a range with an upper end, or below 0 only
def test_a_small_and_a_large_input_are_judged_alike_wherever_the_bad_value_lies(rows, table):
    facts = ValueFacts(low=3, high=9, rows=10) if table else ValueFacts(low=3, high=9)
    check = ValueCheck.of(_graph("int64", facts))
    assert check is not None
    good = torch.arange(4 * rows).reshape(rows, 4) % 10
    assert check.outside([good]) is None
    assert check.outside([good.t()]) is None  # not contiguous
    for place in (0, good.numel() - 1):
        for bad in [-1, 10] if table else [-1]:
            sent = good.clone().view(-1)
            sent[place] = bad
            assert check.outside([sent.view(rows, 4)]) is not None, (place, bad)
    if not table:
        assert check.outside([torch.full((rows, 4), 10**6)]) is None  # no upper end: any id above 0 is eager's to judge


class Tables(torch.nn.Module):
    """Shifted ids (not as they are), token types through two tables (one as a flat view), a float input."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 2)
        self.types = torch.nn.Embedding(3, 2)
        self.more_types = torch.nn.EmbeddingBag(5, 2)

    def forward(self, ids: torch.Tensor, types: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        flat = self.types(types.view(-1)).view(*types.shape, 2)
        return self.embed(ids + 1) + flat + self.more_types(types).unsqueeze(1) + x


def test_a_tables_rows_count_for_an_input_it_indexes_as_it_is_the_fewest_where_several_do():
    sample = Sample((torch.tensor([[0, 8]]), torch.tensor([[0, 2]]), torch.zeros(1, 2, 2)))
    assert table_rows(GraphRecording(samples=[sample]), Tables()) == [None, 3, None]
    assert table_rows(GraphRecording(samples=[sample]), torch.nn.Linear(2, 2)) == []  # no table: not run
