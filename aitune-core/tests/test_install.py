"""``aitune.engine.install``: the one way winners are put on a module, an ``ait.Module`` or a plain one."""

from __future__ import annotations

import torch

import aitune.torch as ait
from aitune.builtin.eager import TorchEagerBackend
from aitune.engine.install import TunedForward, install, reset
from aitune.testing.backends import ToyBackend


def tuned() -> ait.Module:
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    model = ait.Module(inner, "mlp", strategy=ait.FirstWinsStrategy([ToyBackend()], performance_validation=False))
    ait.tune(model, [torch.randn(4, 8)], freeze=False)
    assert model.state == "tuned"
    return model


def test_winners_installed_on_a_plain_module_serve_its_calls_until_reset(toy_backends) -> None:
    model = tuned()
    winners = list(model.tuned_graphs)
    plain = model.module  # the module the winners were built for, unwrapped
    backend = winners[0].backend
    x = torch.randn(4, 8)
    expected = type(plain).forward(plain, x)
    install(plain, winners, model.report, name="mlp")
    assert isinstance(plain.__dict__["forward"], TunedForward)
    assert plain.__dict__["forward"].backends == ("toy",)
    before = backend.calls
    with torch.no_grad():
        torch.testing.assert_close(plain(x), expected)
    assert backend.calls == before + 1
    reset(plain)
    assert "forward" not in plain.__dict__
    with torch.no_grad():
        plain(x)
    assert backend.calls == before + 1, "a reset module still called its winner"


def test_an_ait_module_with_eager_winners_passes_through_and_reset_records_again(toy_backends) -> None:
    model = tuned()
    report = model.report
    eager = [(graph, TorchEagerBackend()) for graph, _ in model.tuned_graphs]
    install(model, eager, report)
    assert model.state == "passthrough" and model.report is report
    assert [b for _, b in model.tuned_graphs] == [b for _, b in eager]
    reset(model)
    assert model.state == "recording" and model.tuned_graphs == [] and model.report is report
