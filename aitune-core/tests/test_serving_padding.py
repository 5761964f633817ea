"""Requests of different lengths in one call (``aitune.torch.serving.Padding``): padding declared with
``ait.tune(pad=...)`` (kept in the artifact) or by the server, checked when the server loads, each answer
cut back to its own length; and ``ait.tune(pad=...)`` recording the unpadded form of each call, so a
model that drops an all-ones mask still runs tuned on an unpadded one."""

from __future__ import annotations

import warnings

import pytest
import torch

import aitune.torch as ait
from aitune.errors import InputError
from aitune.testing import assert_matches_eager
from aitune.testing.backends import ToyBackend
from aitune.torch.serving import (
    Answer,
    BatchPlan,
    BatchRunner,
    Padding,
    input_specs,
    model_graph,
    parse_pad,
)

PAD = {"input_ids": 0, "attention_mask": 0}


class Encoder(torch.nn.Module):
    """Token states ``[batch, seq, 8]`` and a mask-weighted mean ``[batch, 8]``: padded positions (mask 0)
    change neither at a real position."""

    def __init__(self, use_mask: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.use_mask = use_mask

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.proj(self.emb(input_ids))
        m = attention_mask.unsqueeze(-1).to(h.dtype) if self.use_mask else torch.ones_like(h[..., :1])
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1)
        return {"tokens": h + pooled.unsqueeze(1), "pooled": pooled}


def tokens(rows: int, length: int, seed: int = 0, padded: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, length, dtype=torch.long)
    if padded:
        mask[:, -padded:] = 0
    return {"input_ids": torch.randint(1, 50, (rows, length), generator=g), "attention_mask": mask}


def _strategy() -> ait.FirstWinsStrategy:
    return ait.FirstWinsStrategy([ToyBackend()], performance_validation=False)


def tuned_encoder(pad: dict | None = PAD, use_mask: bool = True) -> ait.Module:
    """Tuned for 1 to 4 rows of 4 to 12 tokens."""
    model = ait.Module(Encoder(use_mask).eval(), "encoder", strategy=_strategy())
    ait.tune(model, [tokens(1, 4), tokens(4, 12, seed=1)], pad=pad, end_to_end=False)
    return model


@pytest.fixture
def encoder(toy_backends) -> ait.Module:
    return tuned_encoder()


def _eager(request: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return Encoder().eval()(**request)


def _runner(model: torch.nn.Module, declared: dict | None = None) -> tuple[BatchRunner, list]:
    specs = input_specs(model)
    plan = BatchPlan.of(model)
    plain = BatchRunner(model, plan, specs)

    def call(request):
        [answer] = plain.run([request])
        assert isinstance(answer, Answer), answer
        return answer

    padding = Padding.of(model, specs, declared).probe(call, model_graph(model), plan.ranges[0][0])
    calls: list = []
    return BatchRunner(model, plan, specs, on_call=calls.append, padding=padding), calls


# -- what is padded ------------------------------------------------------------------------------------------


def test_declared_padding_names_the_inputs_and_their_dynamic_axes(encoder):
    padding = Padding.of(encoder, input_specs(encoder))
    assert padding.active and padding.values == {"input_ids": 0.0, "attention_mask": 0.0}
    dim = model_graph(encoder).inputs[0].dims[1]
    assert padding.axes == {"input_ids": {1: dim}, "attention_mask": {1: dim}}
    assert padding.ranges == {dim: (4, 12)}
    assert padding.describe() == "input_ids=0, attention_mask=0"


def test_without_a_declaration_nothing_is_padded_and_it_says_how_to_declare_it(toy_backends):
    model = tuned_encoder(pad=None)
    padding = Padding.of(model, input_specs(model))
    assert not padding.active
    assert padding.describe().startswith("none: no padding is known") and "--pad" in padding.describe()
    # the server's declaration is enough
    assert Padding.of(model, input_specs(model), {"input_ids": 0, "attention_mask": 0}).active


def test_a_padded_length_some_input_shares_without_a_pad_value_is_refused(toy_backends):
    model = tuned_encoder(pad=None)
    padding = Padding.of(model, input_specs(model), {"input_ids": 0})
    assert not padding.active and "attention_mask has the padded length too" in padding.reason


def test_a_name_the_model_does_not_take_is_an_error(encoder):
    with pytest.raises(ValueError, match="'token_ids', which the model does not take"):
        Padding.of(encoder, input_specs(encoder), {"token_ids": 0})


def test_pad_declarations_are_checked():
    assert parse_pad("input_ids=0, attention_mask=0") == {"input_ids": 0.0, "attention_mask": 0.0}
    assert parse_pad(["input_ids=1", "x=-0.5"]) == {"input_ids": 1.0, "x": -0.5}
    for bad in ("input_ids", "input_ids=zero", "=0", "x=nan", "x=inf"):
        with pytest.raises(ValueError):
            parse_pad(bad)
    with pytest.raises(InputError, match="ait.tune"):
        ait.tune(torch.nn.Identity(), [torch.zeros(1)], pad={"x": "0"})


# -- the load-time check ---------------------------------------------------------------------------------------


def test_the_check_finds_the_output_axes_that_follow_the_length(encoder):
    runner, _ = _runner(encoder)
    dim = model_graph(encoder).inputs[0].dims[1]
    assert runner.padding.active and runner.padding.cuts == {"tokens": {1: dim}}  # pooled has no sequence axis


def test_padding_that_changes_the_answers_is_not_used(toy_backends):
    model = tuned_encoder(use_mask=False)  # its mean counts padded positions too
    runner, _ = _runner(model)
    assert not runner.padding.active
    assert "changed output tokens at the real positions" in runner.padding.reason


# -- requests of different lengths ------------------------------------------------------------------------------


def test_requests_of_different_lengths_join_one_call_each_answer_cut_back(encoder):
    runner, calls = _runner(encoder)
    requests = [tokens(1, 5, seed=2, padded=0), tokens(1, 9, seed=3), tokens(2, 7, seed=4, padded=2)]
    answers = runner.run(requests)
    assert len(calls) == 1 and calls[0].rows == 4  # one call of all four rows
    for request, answer in zip(requests, answers):
        assert isinstance(answer, Answer), answer
        assert answer.joined == 3 and answer.backends == ("encoder=toy",) and answer.eager_reasons == ()
        assert list(answer.padded_to.values()) == [9]
        assert_matches_eager(answer.outputs, _eager(request))  # each at its own length


def test_a_short_request_is_padded_up_to_the_tuned_range_and_runs_tuned(encoder):
    runner, _ = _runner(encoder)
    request = tokens(1, 2, padded=0)  # shorter than the 4 tuned
    [answer] = runner.run([request])
    assert isinstance(answer, Answer) and answer.eager_reasons == () and list(answer.padded_to.values()) == [4]
    assert_matches_eager(answer.outputs, _eager(request))


def test_a_request_longer_than_the_tuned_range_joins_no_one(encoder):
    runner, calls = _runner(encoder)
    requests = [tokens(1, 5), tokens(1, 20)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the long one runs eager, warned once
        short, long = runner.run(requests)
    assert isinstance(short, Answer) and isinstance(long, Answer)
    assert short.joined == long.joined == 1 and len(calls) == 2
    assert long.eager_reasons and long.padded_to == {}
    assert_matches_eager(long.outputs, _eager(requests[1]))


def test_without_padding_requests_of_different_lengths_run_apart(encoder):
    specs = input_specs(encoder)
    calls: list = []
    runner = BatchRunner(encoder, BatchPlan.of(encoder), specs, on_call=calls.append)
    answers = runner.run([tokens(1, 5), tokens(1, 9)])
    assert [a.joined for a in answers] == [1, 1] and len(calls) == 2


# -- the artifact keeps it ----------------------------------------------------------------------------------------


def test_the_artifact_keeps_the_declaration(encoder, tmp_path):
    path = ait.save(encoder, tmp_path / "encoder.ait")
    loaded = ait.load(Encoder().eval(), path)
    assert loaded.pad == {"input_ids": 0.0, "attention_mask": 0.0}
    assert Padding.of(loaded, input_specs(loaded)).active


# -- an unpadded call runs tuned --------------------------------------------------------------------------------


class Body(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.proj(hidden)
        return h if mask is None else h * mask.unsqueeze(-1)


class DropsAllOnes(torch.nn.Module):
    """As transformers does: an all-ones mask is passed on as None, so the body is called another way."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 8)
        self.body = Body()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = None if bool(attention_mask.all()) else attention_mask.float()
        return self.body(self.emb(input_ids), mask)


def _routes_of_an_unpadded_call(model: torch.nn.Module) -> list:
    with ait.observe_routes() as seen, torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model(**tokens(2, 6, padded=0))
    return seen


def test_a_declared_mask_is_also_recorded_unpadded_so_an_unpadded_call_runs_tuned(toy_backends):
    model = DropsAllOnes().eval()
    ait.wrap(model, ["body"], strategy=_strategy())
    data = [tokens(1, 4), tokens(4, 12, seed=1)]  # padded only, as the docs' recipe tunes
    ait.tune(model, data, pad=PAD, end_to_end=False)
    assert len(model.body.tuned_graphs) == 2  # the mask, and None
    [route] = _routes_of_an_unpadded_call(model)
    assert route.backend == "toy" and not route.reason, route


def test_without_a_declaration_only_the_dataset_calls_are_recorded(toy_backends):
    model = DropsAllOnes().eval()
    ait.wrap(model, ["body"], strategy=_strategy())
    ait.tune(model, [tokens(1, 4), tokens(4, 12, seed=1)], end_to_end=False)
    assert len(model.body.tuned_graphs) == 1
    [route] = _routes_of_an_unpadded_call(model)
    assert route.reason  # the graph with None was never recorded: eager


def test_the_unpadded_calls_add_nothing_to_graphs_the_dataset_recorded(toy_backends):
    model = ait.Module(Encoder().eval(), "encoder", strategy=_strategy())
    report = ait.tune(model, [tokens(1, 4), tokens(4, 12, seed=1)], pad=PAD, end_to_end=False)
    [graph] = model.tuned_graphs
    assert len(report.modules[0].graphs) == 1
    assert graph[0].inputs[1].values.mask  # still the dataset's padded masks, 0 and 1


# -- aitune serve --pad -------------------------------------------------------------------------------------------


def test_serve_checks_its_pad_option(tmp_path):
    from typer.testing import CliRunner

    from aitune.cli import app

    artifact = tmp_path / "model.ait"
    artifact.write_bytes(b"")
    result = CliRunner().invoke(app, ["serve", str(artifact), "--factory", "m:b", "--pad", "input_ids"])
    assert result.exit_code == 2 and "NAME=VALUE" in result.output
    result = CliRunner().invoke(app, ["serve", str(artifact), "--factory", "m:b", "--engine", "ray", "--pad", "x"])
    assert result.exit_code == 2 and "NAME=VALUE" in result.output  # both engines read --pad alike
