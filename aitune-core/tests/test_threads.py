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


def test_one_thread_budget_for_every_candidate(toy_backends) -> None:
    """ait.tune(threads=N): eager and every candidate run under N threads, and the report says so."""
    import pytest

    from aitune.errors import InputError

    before = torch.get_num_threads()
    try:
        strategy = ait.FirstWinsStrategy([ToyBackend()], performance_validation=False)
        model = ait.Module(torch.nn.Linear(8, 8).eval(), "m", strategy=strategy)
        report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], threads=1)
        assert torch.get_num_threads() == 1 and report.environment["threads"] == 1
        with pytest.raises(InputError, match="threads must be an int >= 1"):
            ait.tune(model, [torch.randn(2, 8)], threads=0)
    finally:
        torch.set_num_threads(before)


def test_a_refused_tune_changes_nothing_not_even_the_thread_budget(toy_backends) -> None:
    """Every argument of ait.tune is checked before anything happens: a bad one later in the list
    leaves the thread count, the data and the module as they were."""
    import pytest

    from aitune.errors import InputError

    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    model = ait.Module(torch.nn.Linear(8, 8).eval(), "m")
    consumed = []

    def data():
        consumed.append(True)
        yield torch.randn(2, 8)

    try:
        with pytest.raises(InputError, match="time_budget must be a number of seconds > 0"):
            ait.tune(model, data(), threads=wanted, time_budget=-1)
        assert torch.get_num_threads() == before, "threads were set by a call that was refused"
        assert not consumed and model.state == "recording"
    finally:
        torch.set_num_threads(before)


def test_a_backend_with_variants_is_one_candidate_per_variant(toy_backends, register_plugin) -> None:
    """Backend.default_configs: each listed config is its own default candidate, named by its variant."""
    from aitune.engine.plan import default_backends
    from aitune.plugins import get_manager

    registry = get_manager().registry
    defaults = default_backends(registry, torch.device("cpu"))
    names = [b.name for b in defaults]
    if "onnxruntime" in registry and not registry.unavailable("onnxruntime", torch.device("cpu")):
        variants = [b.variant() for b in defaults if b.name == "onnxruntime"]
        assert variants[:2] == [None, "torchscript export"], variants
    assert len(names) == sum(len(registry.backend_class(n).default_configs()) for n in dict.fromkeys(names))
