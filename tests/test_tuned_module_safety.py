"""Each CPU backend, tuned through the real entry points, never answers differently from eager silently.

Threads, autograd, training mode and new weights: the cases where a tuned module used to return
something other than what eager PyTorch returns, without a word.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import aitune.torch as ait
from aitune.plugins import get_manager

CANDIDATES = {
    "onnxruntime": {},
    "torch_inductor_aot": {},
    "torch_inductor_jit": {},
    "torchao": {"quantization": "int8wo", "compile": False},
}
THREADS, CALLS = 8, 200


def available() -> list[str]:
    registry = get_manager().registry
    return [n for n in CANDIDATES if n in registry and not registry.status(n).reason("cpu")]


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 8)
    ).eval()


def tune(name: str) -> ait.Module:
    registry = get_manager().registry
    backend = registry.backend_class(name)(registry.config_class(name)(**CANDIDATES[name]))
    model = ait.Module(mlp(), name, strategy=ait.FirstWinsStrategy([backend], performance_validation=False))
    ait.tune(model, [torch.randn(4, 16), torch.randn(8, 16)], freeze=False)  # the guard's cases need grads
    assert model.state == "tuned", model.report.summary
    return model


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4) -> bool:
    return float((actual - expected).abs().max()) <= rtol * float(expected.abs().max()) + 1e-6


@pytest.fixture(scope="module")
def tuned() -> dict[str, ait.Module]:
    names = available()
    if not names:
        pytest.skip("no backend besides eager can run here")
    return {name: tune(name) for name in names}


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_eight_threads_get_the_outputs_one_thread_gets(tuned: dict[str, ait.Module], name: str) -> None:
    if name not in tuned:
        pytest.skip(f"{name} cannot run here")
    model = tuned[name]
    inputs = [torch.randn(4 + i % 5, 16) for i in range(THREADS)]  # other values and batch sizes per thread
    with torch.no_grad():
        expected = [model(x) for x in inputs]
        assert all(close(y, model.module(x), rtol=0.05) for x, y in zip(inputs, expected))
    wrong: list[str] = []

    def serve(i: int) -> None:
        with torch.inference_mode():  # grad mode is per thread
            for call in range(CALLS):
                if not close(model(inputs[i]), expected[i]):
                    wrong.append(f"thread {i} call {call}")
                    return

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no call fell back to eager
        threads = [threading.Thread(target=serve, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert wrong == []


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_backward_through_a_tuned_module_gives_eagers_gradients(tuned: dict[str, ait.Module], name: str) -> None:
    if name not in tuned:
        pytest.skip(f"{name} cannot run here")
    model, eager = tuned[name], mlp()
    model.zero_grad()
    x = torch.randn(6, 16)
    pre = torch.nn.Linear(16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the one warning that this call runs eager
        model(pre(x)).sum().backward()
    eager(pre(x)).sum().backward()
    for mine, theirs in zip(model.module.parameters(), eager.parameters()):
        assert mine.grad is not None and close(mine.grad, theirs.grad)


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_training_mode_and_new_weights_give_eagers_outputs(name: str) -> None:
    if name not in available():
        pytest.skip(f"{name} cannot run here")
    model = tune(name)  # its own: training mode updates the running statistics
    x = torch.randn(6, 16)
    eager = mlp().train()
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="training mode"):
        assert close(model.train()(x), eager(x))
    eager.eval()
    model.eval()
    new = {k: v * 1.5 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.load_state_dict(new)
    eager.load_state_dict(new)
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y = model(x)
    stale = [w for w in seen if "weights changed since it was tuned" in str(w.message)]
    winner = model.tuned_graphs[0][1]
    # live weights, or refitted with them and checked (a payload that folded BatchNorm's statistics away fails it)
    kept = winner.follows_weights() or model.stale_reason is None
    assert len(stale) == (0 if kept else 1), [str(w.message) for w in seen]
    assert close(y, eager(x), rtol=0.05 if name == "torchao" else 1e-4)
