"""One tuned module called from many threads at once: every call gets its own input's answer."""

from __future__ import annotations

import threading

import torch

import aitune.torch as ait
from aitune.testing.backends import ToyBackend


def test_eight_threads_share_one_tuned_module(toy_backends) -> None:
    torch.manual_seed(0)
    strategy = ait.FirstWinsStrategy([ToyBackend()], performance_validation=False)
    model = ait.Module(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).eval(), "m", strategy=strategy)
    ait.tune(model, [torch.randn(2, 8), torch.randn(6, 8)])
    [(_, backend)] = model.tuned_graphs
    inputs = [torch.randn(2 + i % 5, 8) for i in range(8)]  # the dispatcher's table fills from many threads
    with torch.no_grad():
        expected = [model.module(x) for x in inputs]
    wrong: list[int] = []

    def serve(i: int) -> None:
        with torch.inference_mode():
            for _ in range(200):
                y = model(inputs[i])
                if float((y - expected[i]).abs().max()) > 1e-5:
                    wrong.append(i)
                    return

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [] and backend.calls >= 8 * 200
