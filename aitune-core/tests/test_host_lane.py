"""A lone request of host numpy arrays answered from the arrays (``aitune.engine.host``): where the
dispatcher would send the call to a backend that runs arrays, the lane answers exactly as that call
would; anywhere else it declines, and the tensor path answers as it always did (warnings included).

The toy backend below runs arrays by way of its module copy, and counts each kind of call, so each
test can tell which path answered."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune import tree
from aitune.engine.host import host_lane
from aitune.testing.backends import ToyBackend
from aitune.torch.serving import (
    Answer,
    BatchPlan,
    BatchRunner,
    ClientError,
    Padding,
    input_specs,
    model_graph,
    named_outputs,
)


class HostToyBackend(ToyBackend):
    """The toy backend, which also runs host arrays (raising there once it made ``fail_after`` calls)."""

    name = "toy_host"
    fail_after: int | None = None

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.host_calls = 0

    def runs_host_arrays(self) -> bool:
        return True

    def infer_host(self, arrays: Sequence[Any]) -> list[Any]:
        if self.fail_after is not None and self.host_calls >= self.fail_after:
            raise RuntimeError("the host path failed on purpose")
        assert self.module is not None and all(isinstance(a, np.ndarray) for a in arrays)
        self.host_calls += 1
        with torch.no_grad():
            out = self.module(*(torch.from_numpy(a.copy()) for a in arrays))
        return [t.numpy() for t in tree.flatten(out)[0]]  # in the output structure's order


def _tuned() -> tuple[ait.Module, HostToyBackend]:
    """A small MLP tuned with the host toy for 2 to 4 rows of 8 features, and the backend serving it."""
    strategy = ait.FirstWinsStrategy([HostToyBackend()], performance_validation=False)
    model = ait.Module(SlowModule(delay_s=0).eval(), "mlp", strategy=strategy)
    ait.tune(model, [torch.randn(rows, 8) for rows in (2, 4)])
    [(_, backend)] = model.tuned_graphs
    assert isinstance(backend, HostToyBackend)
    backend.calls = 0  # those of tuning
    return model, backend


@pytest.fixture
def tuned() -> tuple[ait.Module, HostToyBackend]:
    return _tuned()


def _run(model: torch.nn.Module, request: dict[str, Any]) -> tuple[Any, list[Any]]:
    calls: list[Any] = []
    runner = BatchRunner(model, BatchPlan.of(model), input_specs(model), on_call=calls.append)
    [answer] = runner.run([request])
    assert not isinstance(answer, ClientError), answer
    return answer, calls


def _eager(x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return SlowModule(delay_s=0).eval()(torch.from_numpy(x.copy())).numpy()


@pytest.mark.parametrize("rows", [2, 3, 4], ids=["min", "unrecorded", "max"])
def test_a_lone_request_of_arrays_is_answered_from_them_as_eager_and_says_its_route(tuned, rows):
    model, backend = tuned
    x = np.random.default_rng(rows).standard_normal((rows, 8)).astype(np.float32)
    x.flags.writeable = False  # a view of a request's bytes, as kserve decodes a binary body
    answer, calls = _run(model, {"x": x})
    assert isinstance(answer.outputs["output"], np.ndarray)
    np.testing.assert_allclose(answer.outputs["output"], _eager(x), atol=1e-6)
    assert answer.backends == ("mlp=toy_host",) and answer.eager_reasons == () and answer.batch_sizes == (rows,)
    assert [(c.size, c.rows, [r.backend for r in c.routes]) for c in calls] == [(rows, rows, ["toy_host"])]
    assert backend.host_calls == 1 and backend.calls == 0


def _declined(model: ait.Module, backend: HostToyBackend, x: np.ndarray) -> Any:
    """The answer of the tensor path, after the lane declined ``x``."""
    answer, _ = _run(model, {"x": x})
    assert backend.host_calls == 0
    assert isinstance(answer.outputs["output"], torch.Tensor)
    return answer


def test_a_hook_added_after_tuning_sends_the_call_down_the_tensor_path_which_runs_it(tuned):
    model, backend = tuned
    model.module.fc.register_forward_hook(lambda module, args, out: out * 0)
    with pytest.warns(RuntimeWarning, match="hooks were added"):
        answer = _declined(model, backend, np.ones((2, 8), np.float32))
    assert answer.outputs["output"].abs().max() == 0  # the hook ran: eager did
    assert backend.calls == 0


def test_a_hook_on_the_wrapper_itself_runs_too(tuned):
    model, backend = tuned
    model.register_forward_hook(lambda module, args, out: out + 1)
    answer = _declined(model, backend, np.zeros((2, 8), np.float32))
    assert torch.allclose(answer.outputs["output"], torch.from_numpy(_eager(np.zeros((2, 8), np.float32))) + 1)


def test_training_mode_is_judged_by_the_tensor_path():
    class Dropping(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.drop = torch.nn.Dropout(0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(self.fc(x))

    backend = HostToyBackend()
    model = ait.Module(
        Dropping().eval(), "mlp", strategy=ait.FirstWinsStrategy([backend], performance_validation=False)
    )
    ait.tune(model, [torch.randn(rows, 8) for rows in (2, 4)])
    [(_, backend)] = model.tuned_graphs
    model.train()
    with pytest.warns(RuntimeWarning, match="training mode"):
        _declined(model, backend, np.ones((2, 8), np.float32))


def test_weights_loaded_after_tuning_are_served_by_eager_not_by_the_old_payload(tuned):
    model, backend = tuned
    new = {k: v + 1 for k, v in model.state_dict().items()}
    with pytest.warns(RuntimeWarning, match="weights changed"):
        model.load_state_dict(new)
        answer = _declined(model, backend, np.ones((2, 8), np.float32))
    expected = SlowModule(delay_s=0).eval()
    expected.load_state_dict(new)
    with torch.no_grad():
        assert torch.allclose(answer.outputs["output"], expected(torch.ones(2, 8)))


def test_sizes_outside_every_tuned_range_take_the_tensor_path(tuned):
    model, backend = tuned
    with pytest.warns(RuntimeWarning, match="outside what was tuned"):
        runner = BatchRunner(model, BatchPlan(((1, 8),)), input_specs(model))  # a plan wider than the graph
        [answer] = runner.run([{"x": np.ones((6, 8), np.float32)}])
    assert not isinstance(answer, ClientError) and isinstance(answer.outputs["output"], torch.Tensor)
    assert backend.host_calls == 0 and "mlp: it is outside what was tuned" in answer.eager_reasons[0]


def test_a_request_padded_or_split_into_tuned_sizes_is_answered_from_its_arrays_too(tuned):
    model, backend = tuned
    for rows, calls_made in ((1, [(2, 1)]), (7, [(4, 4), (3, 3)])):  # 1 padded to 2; 7 cut into 4 and 3
        x = np.random.default_rng(rows).standard_normal((rows, 8)).astype(np.float32)
        answer, calls = _run(model, {"x": x})
        assert isinstance(answer.outputs["output"], np.ndarray) and answer.outputs["output"].shape == (rows, 8)
        np.testing.assert_allclose(answer.outputs["output"], _eager(x), atol=1e-6)
        assert [(c.size, c.rows) for c in calls] == calls_made
    assert backend.host_calls == 3 and backend.calls == 0


def test_a_backend_failing_on_arrays_leaves_the_call_to_the_tensor_path(tuned):
    model, backend = tuned
    backend.fail_after = 0
    answer = _declined(model, backend, np.ones((2, 8), np.float32))
    assert answer.backends == ("mlp=toy_host",) and backend.calls == 1


def test_another_dtype_or_a_tensor_request_takes_the_tensor_path(tuned):
    model, backend = tuned
    runner = BatchRunner(model, BatchPlan.of(model), input_specs(model))
    with pytest.warns(RuntimeWarning, match="outside what was tuned"):
        [refused] = runner.run([{"x": np.ones((2, 8), np.float64)}])
    assert isinstance(refused, ClientError) and "x is float64, tuned with float32" in str(refused)
    answer, _ = _run(model, {"x": torch.ones(2, 8)})
    assert isinstance(answer.outputs["output"], torch.Tensor) and backend.host_calls == 0


def test_no_lane_for_an_untuned_model_or_a_call_no_graph_takes_by_keyword(tuned):
    model, _ = tuned
    assert host_lane(SlowModule(), {"x": torch.ones(2, 8)}, named_outputs) is None
    assert host_lane(model, {"x": torch.ones(2, 8), "mask": torch.ones(2, 8)}, named_outputs) is None
    lane = host_lane(model, {"x": torch.ones(2, 8)}, named_outputs)
    assert lane is not None and lane.paths == ("x",)


def test_requests_that_arrive_together_are_joined_from_their_arrays(tuned):
    model, backend = tuned
    runner = BatchRunner(model, BatchPlan.of(model), input_specs(model))
    xs = [np.random.default_rng(seed).standard_normal((1, 8)).astype(np.float32) for seed in (1, 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        answers = runner.run([{"x": x} for x in xs])
    for x, answer in zip(xs, answers):
        assert not isinstance(answer, ClientError) and answer.joined == 2 and answer.batch_sizes == (2,)
        np.testing.assert_allclose(answer.outputs["output"], _eager(x), atol=1e-6)
    assert backend.host_calls == 1 and backend.calls == 0


def test_a_call_declined_midway_sends_the_whole_group_down_the_tensor_path_each_call_counted_once(tuned):
    model, backend = tuned
    backend.fail_after = 1  # the first of the two calls runs on arrays, the second fails there
    x = np.random.default_rng(7).standard_normal((7, 8)).astype(np.float32)
    answer, calls = _run(model, {"x": x})
    assert isinstance(answer.outputs["output"], torch.Tensor)
    np.testing.assert_allclose(answer.outputs["output"].numpy(), _eager(x), atol=1e-6)
    assert [(c.size, c.rows) for c in calls] == [(4, 4), (3, 3)] and backend.calls == 2


class Tokens(torch.nn.Module):
    """Token ids through an embedding of 100 rows, by keyword as a tokenizer's output is passed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(100, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return (self.embed(input_ids) * attention_mask.unsqueeze(-1)).mean(dim=1)


@pytest.mark.parametrize("rows", [2, 4], ids=["checked-on-a-list", "checked-by-numpy"])  # 140 and 280 ids
def test_an_id_outside_the_embedding_takes_the_tensor_path_which_refuses_it(rows):
    strategy = ait.FirstWinsStrategy([HostToyBackend()], performance_validation=False)
    model = ait.Module(Tokens().eval(), "tokens", strategy=strategy)
    g = torch.Generator().manual_seed(0)
    ait.tune(
        model,
        [
            {
                "input_ids": torch.randint(0, 50, (b, 70), generator=g),
                "attention_mask": torch.ones(b, 70, dtype=torch.long),
            }
            for b in (2, 4)
        ],
    )
    [(_, backend)] = model.tuned_graphs
    assert isinstance(backend, HostToyBackend)
    ids, mask = np.full((rows, 70), 99, np.int64), np.ones((rows, 70), np.int64)  # 99: never seen, yet a row
    answer, _ = _run(model, {"attention_mask": mask, "input_ids": ids})  # in another order than recorded
    assert isinstance(answer.outputs["output"], np.ndarray) and backend.host_calls == 1
    ids[-1, -1] = 100
    runner = BatchRunner(model, BatchPlan.of(model), input_specs(model))
    with pytest.warns(RuntimeWarning, match="input_ids holds a value outside 0..99"):
        [refused] = runner.run([{"input_ids": ids, "attention_mask": mask}])
    assert isinstance(refused, ClientError) and "IndexError" in str(refused) and backend.host_calls == 1


class Encoder(torch.nn.Module):
    """Token states and a mask-weighted mean: an answer with an output that follows the length."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.emb(input_ids)
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return {"tokens": h, "pooled": (h * m).sum(1) / m.sum(1).clamp(min=1)}


def test_with_padding_known_requests_of_any_tuned_length_are_padded_joined_and_cut_back_on_their_arrays():
    """A lone request inside the tuned lengths runs as sent, one shorter is padded up to them, and two
    of different lengths join one call padded to the longer; each answer is cut back to its own length
    and says the length its call ran at."""
    backend = HostToyBackend()
    strategy = ait.FirstWinsStrategy([backend], performance_validation=False)
    model = ait.Module(Encoder().eval(), "encoder", strategy=strategy)
    g = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": torch.randint(1, 50, (b, n), generator=g), "attention_mask": torch.ones(b, n, dtype=torch.long)}
        for b, n in ((1, 4), (4, 12))
    ]
    ait.tune(model, data, pad={"input_ids": 0, "attention_mask": 0}, end_to_end=False)
    [(_, backend)] = model.tuned_graphs
    assert isinstance(backend, HostToyBackend)
    specs, plan = input_specs(model), BatchPlan.of(model)
    plain = BatchRunner(model, plan, specs)
    padding = Padding.of(model, specs).probe(lambda r: plain.run([r])[0], model_graph(model), plan.ranges[0][0])  # type: ignore[arg-type, return-value]
    assert padding.active and padding.cuts == {"tokens": {1: next(iter(padding.ranges))}}
    backend.calls = 0  # those of tuning and of the padding's check
    calls: list[Any] = []
    runner = BatchRunner(model, plan, specs, on_call=calls.append, padding=padding)
    eager = Encoder().eval()
    for lengths, ran_at in (((7,), 7), ((2,), 4), ((5, 9), 9)):  # 2: below the tuned 4..12
        before = backend.host_calls
        requests = [
            {"input_ids": np.random.default_rng(n).integers(1, 50, (1, n)), "attention_mask": np.ones((1, n), np.int64)}
            for n in lengths
        ]
        answers = runner.run(requests)
        assert backend.host_calls == before + 1 and calls[-1].rows == len(lengths)
        for request, answer in zip(requests, answers):
            assert isinstance(answer, Answer) and answer.eager_reasons == ()
            assert list(answer.padded_to.values()) == [ran_at] and answer.joined == len(lengths)
            with torch.no_grad():
                expected = eager(**{k: torch.from_numpy(v) for k, v in request.items()})
            for name, value in expected.items():
                assert isinstance(answer.outputs[name], np.ndarray)
                np.testing.assert_allclose(answer.outputs[name], value.numpy(), atol=1e-6)
    assert backend.calls == 0
