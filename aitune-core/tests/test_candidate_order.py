"""One candidate order: the builds a concurrent executor gets ahead are the ones the strategy tries first.

With a time budget the default candidates are tried cheapest first (``Backend.build_cost``). FirstWins
sends only its first candidate ahead, so sending another one ahead builds, in the executor, a candidate
it may never try, while the one it does try waits for an in-process turn. A strategy that builds every
candidate builds those of the process first, while the ones sent ahead run beside it.
"""

from __future__ import annotations

import torch
from aitune_testkit import executors
from aitune_testkit.doubles import SlowModule
from aitune_testkit.faults import IsolatedToyBackend

import aitune.torch as ait
from aitune import hookimpl
from aitune.plugins import AituneManager
from aitune.registry import BackendRegistry
from aitune.testing.backends import ToyBackend, register


class CostlyIsolated(IsolatedToyBackend):
    name = "toy_costly_isolated"
    build_cost = 10.0


class CheapIsolated(IsolatedToyBackend):
    name = "toy_cheap_isolated"
    build_cost = 0.5


class InProcess(ToyBackend):
    name = "toy_in_process"


class DefaultCandidates:
    """Two isolated default candidates, the costly one declared (so listed) first, then one built in
    the process."""

    @hookimpl
    def aitune_register_backends(self, registry: BackendRegistry) -> None:
        register(registry, (CostlyIsolated, CheapIsolated, InProcess), __name__, default_candidate=True)


def _manager(*plugins: object) -> AituneManager:
    manager = AituneManager()
    for plugin in plugins:
        manager.register(plugin, name=type(plugin).__name__)
    manager.register(DefaultCandidates(), name="default-candidates", distribution="test-plugin")
    manager.register(executors, name="aitune_testkit.executors", distribution="aitune-testkit")
    return manager


class AskedToBuild:
    def __init__(self) -> None:
        self.names: list[str] = []

    @hookimpl(wrapper=True)
    def aitune_build(self, backend):
        self.names.append(backend.name)
        return (yield)


def _tune(monkeypatch, strategy=None, plugins=(), **arguments):
    submitted: list[str] = []
    real_submit = executors.ThreadedExecutor.submit
    monkeypatch.setattr(
        executors.ThreadedExecutor, "submit", lambda self, r: submitted.append(r.what) or real_submit(self, r)
    )
    strategy = strategy or ait.FirstWinsStrategy(performance_validation=False)  # the tune's default candidates
    model = ait.Module(SlowModule(delay_s=0.0).eval(), "m", strategy=strategy)
    report = ait.tune(
        model, [torch.randn(2, 8)], executor="threads", end_to_end=False, manager=_manager(*plugins), **arguments
    )
    [graph] = report.modules[0].graphs
    return submitted, graph


def test_with_a_time_budget_first_wins_sends_ahead_the_candidate_it_tries_first(monkeypatch, aitune_cache_dir):
    monkeypatch.setenv("AITUNE_BUILD_CACHE", "0")
    submitted, graph = _tune(monkeypatch, time_budget=600)
    assert [c.backend for c in graph.candidates] == ["toy_cheap_isolated"], "cheapest tried first, and it won"
    assert graph.decision == "toy_cheap_isolated"
    assert submitted == ["toy_cheap_isolated build of m"], "the build sent ahead is the one tried first"
    assert graph.candidates[0].build_info["built_ahead"], "its turn took the build sent ahead"


def test_without_a_time_budget_first_wins_sends_ahead_its_first_in_declared_order(monkeypatch, aitune_cache_dir):
    monkeypatch.setenv("AITUNE_BUILD_CACHE", "0")
    submitted, graph = _tune(monkeypatch)
    assert [c.backend for c in graph.candidates] == ["toy_costly_isolated"]
    assert submitted == ["toy_costly_isolated build of m"]
    assert graph.candidates[0].build_info["built_ahead"]


def test_max_throughput_builds_in_the_process_while_the_builds_sent_ahead_run(monkeypatch, aitune_cache_dir):
    monkeypatch.setenv("AITUNE_BUILD_CACHE", "0")
    asked = AskedToBuild()
    strategy = ait.MaxThroughputStrategy(performance_validation=False)
    submitted, graph = _tune(monkeypatch, strategy, plugins=[asked])
    assert sorted(submitted) == ["toy_cheap_isolated build of m", "toy_costly_isolated build of m"]
    assert asked.names == ["toy_in_process", "toy_costly_isolated", "toy_cheap_isolated"], (
        "the process builds its own candidate first, not waiting on a worker"
    )
    assert [c.backend for c in graph.candidates] == ["toy_costly_isolated", "toy_cheap_isolated", "toy_in_process"], (
        "the report lists them in the declared order"
    )
