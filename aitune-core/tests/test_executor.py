"""Executors: where isolated builds run, chosen per tune; a concurrent one gets every build at once."""

from __future__ import annotations

import pytest
import torch
from aitune_testkit import executors
from aitune_testkit.doubles import SlowModule
from aitune_testkit.faults import IsolatedToyBackend, RaisingBackend

import aitune.torch as ait
from aitune import executor, hookimpl
from aitune.errors import ConfigError
from aitune.testing import assert_matches_eager
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5), extend_s=0.0
)


@pytest.fixture
def threads(toy_backends, register_plugin):
    from aitune_testkit import faults

    register_plugin(faults, name="aitune_testkit.faults", distribution="aitune-testkit")
    return register_plugin(executors, name="aitune_testkit.executors", distribution="aitune-testkit")


class Pipeline(torch.nn.Module):
    """Two modules, each with its own candidates: an isolated one, an in-process one, a failing one."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = ait.Module(SlowModule(), "encoder", strategy=self._strategy(0.0, 0.5))
        self.head = ait.Module(SlowModule(), "head", strategy=self._strategy(0.6, 0.0))

    @staticmethod
    def _strategy(isolated_speed: float, toy_speed: float) -> ait.MaxThroughputStrategy:
        backends = [IsolatedToyBackend(ToyConfig(speed=isolated_speed)), ToyBackend(ToyConfig(speed=toy_speed))]
        return ait.MaxThroughputStrategy(backends=[*backends, RaisingBackend()], profiling_config=QUICK)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _decisions(report):
    return [
        (m.name, [(g.decision, [(c.backend, c.status) for c in g.candidates]) for g in m.graphs])
        for m in report.modules
    ]


class WatchProfiling:
    """Counts the builds still running whenever profiling starts."""

    def __init__(self) -> None:
        self.in_flight: list[int] = []

    @hookimpl
    def aitune_profile(self, runners, batch_size, config, device, session):
        self.in_flight.append(sum(not a.handle.future.done() for a in session.builds._ahead.values()))


def test_a_concurrent_executor_gets_every_build_first_and_decides_as_local(threads, register_plugin, monkeypatch):
    monkeypatch.setenv("AITUNE_BUILD_CACHE", "0")
    data = [torch.randn(2, 8), torch.randn(4, 8)]
    local = ait.tune(Pipeline(), data, executor="local")
    submitted = []
    real_submit = executors.ThreadedExecutor.submit
    monkeypatch.setattr(
        executors.ThreadedExecutor, "submit", lambda self, r: submitted.append(r.what) or real_submit(self, r)
    )
    model, watch = Pipeline(), register_plugin(WatchProfiling())
    report = ait.tune(model, data, executor="threads")
    assert watch.in_flight and not any(watch.in_flight), "profiling started only once no build was running"
    assert _decisions(report) == _decisions(local)
    assert [d for _, graphs in _decisions(report) for d, _ in graphs] == ["toy_isolated", "toy"]
    assert submitted == [
        "toy_isolated build of encoder",
        "fault_raise build of encoder",
        "toy_isolated build of head",
        "fault_raise build of head",
    ], "the isolated builds of both modules went out before any was taken; the in-process toy did not"
    ahead = next(c for c in report.modules[0].graphs[0].candidates if c.backend == "toy_isolated")
    assert ahead.build_info["built_ahead"] and ahead.build_info["worker_s"] > 0, "the report keeps the build's own time"
    failed = next(c for c in report.modules[0].graphs[0].candidates if c.backend == "fault_raise")
    assert failed.status == "failed" and "rejected the graph on purpose" in failed.reason
    x = torch.randn(3, 8)
    assert_matches_eager(model(x), model.head.module(model.encoder.module(x)))


def test_each_strategy_says_which_builds_go_ahead(threads, monkeypatch):
    """FirstWins sends only its first candidate ahead (the next is built only if the first fails); a
    strategy of one's own answers ``builds_ahead`` for itself, here: none, so its build waits its turn."""
    monkeypatch.setenv("AITUNE_BUILD_CACHE", "0")
    events = []
    real_submit = executors.ThreadedExecutor.submit
    monkeypatch.setattr(
        executors.ThreadedExecutor, "submit", lambda self, r: events.append(r.what) or real_submit(self, r)
    )

    class NothingAhead(ait.MaxThroughputStrategy):
        def builds_ahead(self, candidates):
            return []

        def tune(self, tuning, default_backends):
            events.append(f"{tuning.module_name} tunes")
            return super().tune(tuning, default_backends)

    first = ait.FirstWinsStrategy(
        [IsolatedToyBackend(ToyConfig(speed=0.5)), IsolatedToyBackend(ToyConfig(speed=0.1))],
        performance_validation=False,
    )
    mine = NothingAhead([IsolatedToyBackend(ToyConfig(speed=0.5))], performance_validation=False)

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = ait.Module(SlowModule(), "encoder", strategy=first)
            self.head = ait.Module(SlowModule(), "head", strategy=mine)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x))

    report = ait.tune(Two(), [torch.randn(2, 8)], executor="threads")
    assert [m.status for m in report.modules] == ["tuned", "tuned"]
    assert events == ["toy_isolated build of encoder", "head tunes", "toy_isolated build of head"]


def test_the_executor_comes_from_the_environment_and_unknown_names_say_what_exists(threads, monkeypatch):
    monkeypatch.setenv("AITUNE_EXECUTOR", "threads")
    model = ait.Module(SlowModule(), "m", strategy=ait.OneBackendStrategy(IsolatedToyBackend(), profiling_config=QUICK))
    report = ait.tune(model, [torch.randn(2, 8)])
    assert report.modules[0].graphs[0].candidates[0].build_info["executor"] == "threads"
    monkeypatch.setenv("AITUNE_EXECUTOR", "nosuch")
    with pytest.raises(ConfigError, match=r"no installed plugin provides the executor 'nosuch' \(installed: .*local"):
        ait.tune(model, [torch.randn(2, 8)])


def test_asking_for_a_first_party_executor_that_is_missing_names_its_distribution(aitune_manager):
    aitune_manager.executors.remove("ray")
    with pytest.raises(ConfigError, match="pip install aitune-executor-ray"):
        aitune_manager.executors.create("ray")


def test_local_executor_is_the_default_and_describes_this_machine(aitune_manager, monkeypatch):
    monkeypatch.delenv("AITUNE_EXECUTOR", raising=False)
    monkeypatch.setenv("AITUNE_BUILD_WORKERS", "0")
    assert executor.chosen() == "local"
    local = aitune_manager.executors.create("local")
    assert not local.concurrent and local.describe()["CPU"] >= 1 and local.describe()["beside the tune"] == 0


@pytest.mark.parametrize(
    ("cores", "threads", "workers"),
    [(2, 1, 1), (1, 1, 0), (2, 2, 0), (8, 2, 2), (64, 1, 2), (16, 8, 1)],
)
def test_local_builds_run_beside_the_tune_on_the_cores_its_threads_leave(monkeypatch, cores, threads, workers):
    from aitune.builds import isolation

    monkeypatch.delenv("AITUNE_BUILD_WORKERS", raising=False)
    monkeypatch.setattr(isolation.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(isolation.torch, "get_num_threads", lambda: threads)
    local = isolation.LocalExecutor()
    try:
        assert (local.workers, local.concurrent) == (workers, workers > 0)
    finally:
        local.close()


def test_build_workers_come_from_the_environment_and_a_bad_value_says_what_to_set(monkeypatch):
    from aitune.builds import isolation

    monkeypatch.setenv("AITUNE_BUILD_WORKERS", "3")
    assert isolation.background_workers() == 3
    monkeypatch.setenv("AITUNE_BUILD_WORKERS", "two")
    with pytest.raises(ConfigError, match="AITUNE_BUILD_WORKERS='two' is not a whole number"):
        isolation.background_workers()


def test_local_builds_beside_the_tune_go_ahead_and_profiling_waits_for_them(threads, register_plugin, monkeypatch):
    """With a spare core, the isolated builds of the pipeline are exported and started right after
    recording, profiling starts only once none is running, and the decisions are those of builds
    made one at a time."""
    from aitune.builds import isolation

    monkeypatch.setenv("AITUNE_BUILD_CACHE", "0")
    data = [torch.randn(2, 8), torch.randn(4, 8)]
    monkeypatch.setenv("AITUNE_BUILD_WORKERS", "0")
    one_at_a_time = ait.tune(Pipeline(), data, end_to_end=False)
    monkeypatch.setenv("AITUNE_BUILD_WORKERS", "1")
    submitted = []
    real_submit = isolation.LocalExecutor.submit
    monkeypatch.setattr(
        isolation.LocalExecutor, "submit", lambda self, r: submitted.append(r.what) or real_submit(self, r)
    )
    watch = register_plugin(WatchProfiling())
    report = ait.tune(Pipeline(), data, end_to_end=False)
    assert watch.in_flight and not any(watch.in_flight), "profiling started only once no build was running"
    assert _decisions(report) == _decisions(one_at_a_time)
    assert submitted[:2] == ["toy_isolated build of encoder", "fault_raise build of encoder"]
    assert "toy_isolated build of head" in submitted[2:], "the next module's isolated build went ahead too"
    ahead = next(c for c in report.modules[0].graphs[0].candidates if c.backend == "toy_isolated")
    assert ahead.build_info["built_ahead"] and ahead.build_info["worker_s"] > 0
    assert report.time_spent["export"] > 0, "exports made for the builds ahead count as export"
    assert "encoder: toy_isolated" in report.time_by_candidate


def test_a_build_running_beside_the_tune_is_stopped_when_nobody_will_take_it(threads, tmp_path):
    """A tune that ends early (an error, Ctrl-C) cancels the builds still running: their workers are
    killed at once, and closing the executor does not wait for a build to finish."""
    import time

    from aitune_testkit import faults

    from aitune.backend import BuildContext
    from aitune.builds import isolation
    from aitune.executor import BuildRequest, WorkerBuildError
    from aitune.graph import Sample, infer_graph

    samples = [Sample((torch.randn(2, 8),))]
    context = BuildContext(infer_graph(samples, ("x",)), samples, torch.device("cpu"), tmp_path, tmp_path / "c", "m")
    backend = faults.HangBackend()
    (tmp_path / "exported").mkdir()
    notes = backend.export(SlowModule(), context, tmp_path / "exported")
    local = isolation.LocalExecutor(workers=1)
    handle = local.submit(BuildRequest(backend, notes, context, tmp_path))
    for _ in range(1200):  # the worker process starts (it never finishes on its own)
        if handle._proc is not None:
            break
        time.sleep(0.05)
    handle.cancel()
    with pytest.raises(WorkerBuildError, match="SIGKILL|killed|signal"):
        handle.result()
    local.close()
    assert handle._proc.poll() is not None, "the worker is gone"
