"""``ait.tune`` refuses a bad argument before it changes anything: the executor, from the argument
or ``AITUNE_EXECUTOR``, and the rank decision are checked with the other options, before the thread
budget is set or a module is switched to eval mode."""

from __future__ import annotations

import pytest
import torch

import aitune.torch as ait
from aitune.errors import ConfigError
from aitune.testing.backends import ToyBackend


def _training_model() -> ait.Module:
    """A module in training mode whose code reads ``self.training``: ``set_eval=True`` would switch it."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    return ait.Module(net, "m", strategy=ait.OneBackendStrategy(ToyBackend()))


@pytest.mark.parametrize(
    ("arguments", "environment", "message"),
    [
        ({"executor": "nosuch"}, {}, r"no installed plugin provides the executor 'nosuch' \(installed: .*local"),
        ({}, {"AITUNE_EXECUTOR": "Nosuch"}, r"no installed plugin provides the executor 'nosuch'"),
        ({"rank_decision": "fastest"}, {}, r"rank_decision='fastest' is not one of rank0, slowest"),
        ({}, {"AITUNE_RANK_DECISION": "fastest"}, r"AITUNE_RANK_DECISION='fastest' is not one of rank0, slowest"),
    ],
)
def test_a_refused_tune_leaves_the_thread_budget_and_the_model_as_they_were(
    aitune_manager, monkeypatch, arguments, environment, message
):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    before = torch.get_num_threads()
    model = _training_model()
    with pytest.raises(ConfigError, match=message):
        ait.tune(model, [torch.randn(2, 4)], threads=before + 1, set_eval=True, **arguments)
    assert torch.get_num_threads() == before, "torch.set_num_threads did not run"
    assert model.training, "the model was not switched to eval mode"


def test_the_executor_is_checked_against_the_tune_s_own_manager(aitune_manager):
    model = _training_model().eval()
    aitune_manager.executors.remove("local")
    with pytest.raises(ConfigError, match="no installed plugin provides the executor 'local'"):
        ait.tune(model, [torch.randn(2, 4)], executor="local", manager=aitune_manager)
