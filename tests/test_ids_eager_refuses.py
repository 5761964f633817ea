"""Token ids eager refuses, on ONNX Runtime: its Gather wraps id -1 to the last row where eager raises
IndexError. A tuned call with such an id runs eager with a warning naming the input and its range
(and raises eager's IndexError), raises aitune's error under ``strict``, and ids the embedding takes
stay on ONNX Runtime though tuning never saw them; the check comes back from the artifact."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import aitune.torch as ait
from aitune.engine.dispatch import observe_routes
from aitune.errors import UnsupportedCallError
from aitune.plugins import get_manager
from aitune.testing import assert_matches_eager

VOCAB = 50
RANGE = f"input_ids holds a value outside 0..{VOCAB - 1}, the rows of the embedding it indexes"


class Tokens(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids).mean(dim=1))


def _tuned(strict: bool = False) -> ait.Module:
    registry = get_manager().registry
    if "onnxruntime" not in registry or registry.status("onnxruntime").reason("cpu"):
        pytest.skip("onnxruntime cannot run here")
    from aitune.torch.backend import ONNXRuntimeBackend

    strategy = ait.FirstWinsStrategy([ONNXRuntimeBackend()], performance_validation=False)
    model = ait.Module(Tokens().eval(), "tokens", strategy=strategy, strict=strict)
    g = torch.Generator().manual_seed(0)
    ait.tune(model, [torch.randint(5, 30, (b, 6), generator=g) for b in (2, 4)])
    assert model.state == "tuned" and model.tuned_graphs[0][1].name == "onnxruntime", model.report
    return model


@pytest.fixture(scope="module")
def model() -> ait.Module:
    return _tuned()


def _ids(first: int) -> torch.Tensor:
    return torch.tensor([[first, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]])


def test_onnx_runtime_answers_id_minus_1_where_eager_raises(model):
    """Why the check exists: the tuned payload, called directly, gives row 49's answer for -1."""
    [(_, backend)] = model.tuned_graphs
    with torch.no_grad():
        wrapped = backend.infer(_ids(-1))
        assert_matches_eager(wrapped, model.module(_ids(VOCAB - 1)))
        with pytest.raises(IndexError):
            model.module(_ids(-1))


def test_id_minus_1_runs_eager_named_and_raises_eagers_index_error(model):
    warned = f"tokens: running this call eager: it is outside what was tuned \\({RANGE}"
    with (
        torch.no_grad(),
        observe_routes() as seen,
        pytest.warns(RuntimeWarning, match=warned),
        pytest.raises(IndexError),
    ):
        model(_ids(-1))
    assert [r.backend for r in seen] == ["torch_eager"] and RANGE in (seen[0].reason or "")


def test_ids_the_embedding_takes_stay_on_onnx_runtime_though_tuning_never_saw_them(model):
    ids = _ids(VOCAB - 1)  # tuning saw 5..29
    with torch.no_grad(), warnings.catch_warnings(), observe_routes() as seen:
        warnings.simplefilter("error")
        assert_matches_eager(model(ids), model.module(ids))
    assert [(r.backend, r.reason) for r in seen] == [("onnxruntime", None)]


def test_strict_raises_aitunes_error():
    model = _tuned(strict=True)
    with torch.no_grad(), pytest.raises(UnsupportedCallError, match=RANGE):
        model(_ids(-1))


def test_the_check_comes_back_from_the_artifact(model, tmp_path: Path):
    loaded = ait.load(Tokens().eval(), ait.save(model, tmp_path / "tokens.ait"))
    with torch.no_grad(), observe_routes() as seen:
        with pytest.warns(RuntimeWarning, match=RANGE), pytest.raises(IndexError):
            loaded(_ids(-1))
        loaded(_ids(40))
    assert [r.backend for r in seen] == ["torch_eager", "onnxruntime"]
