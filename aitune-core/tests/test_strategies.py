"""The strategy rules of the product's guide, with toy backends of known speed and correctness."""

from __future__ import annotations

import warnings

import pytest
import torch

import aitune.torch as ait
from aitune.errors import TuningError, ValidationError
from aitune.testing.backends import MutatingBackend, NaNBackend, SlowModule, ToyBackend, ToyConfig, WrongBackend
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

FAST = ToyConfig(speed=0.0)
SLOW = ToyConfig(speed=2.0)
QUICK = ProfilingConfig(measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=20, warmup=2, window=5))


def data(*batches: int, features: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, features, generator=g) for b in batches]


def wrap(strategy: ait.TuneStrategy, **kwargs) -> ait.Module:
    return ait.Module(SlowModule().eval(), "toy-model", strategy=strategy, **kwargs)


def graph_report(report):
    [module] = report.modules
    [graph] = module.graphs
    return graph


def statuses(graph):
    return [(c.backend, c.status) for c in graph.candidates]


# -- OneBackendStrategy ---------------------------------------------------------------------------


def test_one_backend_build_failure_raises_the_original_error(toy_backends):
    model = wrap(ait.OneBackendStrategy(ToyBackend(ToyConfig(fail_build=True)), profiling_config=QUICK))
    with pytest.raises(RuntimeError, match="toy compiler crashed on purpose"):
        ait.tune(model, data(2, 4))
    assert model.state == "passthrough"


def test_one_backend_wrong_numbers_raise(toy_backends):
    model = wrap(ait.OneBackendStrategy(WrongBackend(FAST), profiling_config=QUICK))
    with pytest.raises(ValidationError, match="toy_wrong does not match eager.*off by"):
        ait.tune(model, data(2, 4))


def test_one_backend_correct_but_slower_falls_back_to_eager(toy_backends):
    model = wrap(ait.OneBackendStrategy(ToyBackend(SLOW), profiling_config=QUICK))
    report = ait.tune(model, data(2, 4))
    graph = graph_report(report)
    assert model.state == "passthrough"
    assert graph.decision == "torch_eager"
    assert "correct but not faster" in graph.reason
    assert statuses(graph) == [("toy", "rejected")]
    assert graph.candidates[0].speedup < 1.0


def test_one_backend_faster_wins_and_serves_calls(toy_backends):
    backend = ToyBackend(FAST)
    model = wrap(ait.OneBackendStrategy(backend, profiling_config=QUICK))
    report = ait.tune(model, data(2, 4))
    assert model.state == "tuned"
    assert graph_report(report).candidates[0].speedup > 1.01
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), model.module(x))
    [(_, winner)] = model.tuned_graphs
    assert winner is not backend, "strategies clone the template; the user's object stays unbuilt"
    assert winner.calls > 0


def test_one_backend_without_performance_validation_keeps_a_slower_backend(toy_backends):
    strategy = ait.OneBackendStrategy(ToyBackend(SLOW), profiling_config=QUICK)
    strategy.enable_performance_validation(False)
    model = wrap(strategy)
    report = ait.tune(model, data(2, 4))
    assert model.state == "tuned"
    assert graph_report(report).eager_profiles == [], "no eager baseline is measured when disabled"


def test_min_speedup_ratio_is_the_gate(toy_backends):
    # 2 ms eager vs ~0 ms candidate clears 1.01x easily but not an absurd 1000x bar
    model = wrap(ait.OneBackendStrategy(ToyBackend(FAST), profiling_config=QUICK, min_speedup_ratio=1000.0))
    report = ait.tune(model, data(2, 4))
    assert model.state == "passthrough"
    assert "below the required 1001.00x" in graph_report(report).reason


# -- FirstWinsStrategy ----------------------------------------------------------------------------


def test_first_wins_takes_the_first_that_builds_is_correct_and_faster(toy_backends):
    strategy = ait.FirstWinsStrategy(
        backends=[
            ToyBackend(ToyConfig(fail_build=True)),
            WrongBackend(FAST),
            ToyBackend(SLOW),
            MutatingBackend(FAST),
            NaNBackend(FAST),
            ToyBackend(FAST),
            ToyBackend(ToyConfig(speed=0.5)),
        ],
        profiling_config=QUICK,
    )
    model = wrap(strategy)
    graph = graph_report(ait.tune(model, data(2, 4)))
    assert [c.status for c in graph.candidates] == ["failed", "failed", "rejected", "failed", "failed", "selected"]
    assert [c.stage for c in graph.candidates] == ["build", "validate", None, "validate", "validate", None]
    assert "crashed on purpose" in graph.candidates[0].reason
    assert "modified input" in graph.candidates[3].reason
    assert "NaN" in graph.candidates[4].reason
    assert graph.candidates[5].config == {"backend": "toy", "speed": 0.0, "max_batch": None, "fail_build": False}
    assert model.state == "tuned"


def test_first_wins_runs_eager_when_all_fail_and_says_why(toy_backends):
    model = wrap(ait.FirstWinsStrategy(backends=[WrongBackend(FAST), ToyBackend(SLOW)], profiling_config=QUICK))
    x = torch.randn(4, 8)
    expected = model.module(x)
    graph = graph_report(ait.tune(model, data(2, 4)))
    assert model.state == "passthrough"
    assert graph.reason.startswith("no backend passed")
    assert "toy_wrong" in graph.reason and "toy:" in graph.reason
    torch.testing.assert_close(model(x), expected)


# -- profiling strategies -------------------------------------------------------------------------


def test_max_throughput_picks_the_fastest(toy_backends):
    strategy = ait.MaxThroughputStrategy(
        backends=[ToyBackend(ToyConfig(speed=0.5)), ToyBackend(FAST), ToyBackend(SLOW)], profiling_config=QUICK
    )
    model = wrap(strategy)
    graph = graph_report(ait.tune(model, data(2, 4)))
    assert [c.status for c in graph.candidates] == ["rejected", "selected", "rejected"]
    assert graph.candidates[1].config["speed"] == 0.0
    assert graph.eager_profiles, "the eager baseline is profiled"


def test_max_throughput_falls_back_to_eager_when_nothing_beats_it(toy_backends):
    model = wrap(ait.MaxThroughputStrategy(backends=[ToyBackend(SLOW)], profiling_config=QUICK))
    graph = graph_report(ait.tune(model, data(2, 4)))
    assert model.state == "passthrough" and graph.decision == "torch_eager"


def test_max_throughput_without_validation_keeps_the_fastest_backend(toy_backends):
    strategy = ait.MaxThroughputStrategy(
        backends=[ToyBackend(ToyConfig(speed=3.0)), ToyBackend(SLOW)], profiling_config=QUICK
    ).enable_performance_validation(False)
    model = wrap(strategy)
    graph = graph_report(ait.tune(model, data(2, 4)))
    assert graph.eager_profiles == []
    assert [c.status for c in graph.candidates] == ["rejected", "selected"]


def _clock(latencies_ms: dict[str, list[float]]):
    """A profiling plugin that reports fixed per-window latencies: decisions without timing noise."""
    from aitune import hookimpl
    from aitune.torch.task.profiling import summarize

    class Clock:
        @hookimpl
        def aitune_profile(self, runners, batch_size, config, device):
            return {name: summarize(latencies_ms[name.split("#")[0]], batch_size, 1) for name in runners}

    return Clock()


def test_ties_go_to_eager(toy_backends, register_plugin):
    register_plugin(_clock({"torch_eager": [2.0, 2.1, 1.9, 2.0], "toy": [2.0, 2.0, 2.0, 2.0]}))
    model = wrap(ait.MaxThroughputStrategy(backends=[ToyBackend(ToyConfig(speed=1.0))], profiling_config=QUICK))
    graph = graph_report(ait.tune(model, data(2, 4)))
    assert graph.decision == "torch_eager" and "eager is as fast" in graph.reason


def test_a_gap_inside_the_measured_spread_keeps_eager(toy_backends, register_plugin):
    # faster on median, but slower than eager in half of the windows
    register_plugin(_clock({"torch_eager": [2.0, 2.0, 2.0, 2.0], "toy": [1.0, 1.0, 2.5, 2.6]}))
    model = wrap(ait.MaxThroughputStrategy(backends=[ToyBackend()], profiling_config=QUICK))
    graph = graph_report(ait.tune(model, data(2, 4)))
    assert graph.decision == "torch_eager" and "inside the measured spread" in graph.reason


def test_an_unlucky_eager_window_does_not_hide_a_win(toy_backends, register_plugin):
    register_plugin(
        _clock({"torch_eager": [4.9, 3.6, 4.4, 1.4, 1.35, 1.7], "toy": [0.42, 0.43, 0.44, 0.45, 0.39, 0.41]})
    )
    model = wrap(ait.MaxThroughputStrategy(backends=[ToyBackend()], profiling_config=QUICK))
    graph = graph_report(ait.tune(model, data(2, 4)))
    assert graph.decision == "toy"


def test_wrong_numbers_are_never_chosen_even_when_fastest(toy_backends):
    model = wrap(
        ait.MaxThroughputStrategy(
            backends=[WrongBackend(FAST), ToyBackend(ToyConfig(speed=0.5))], profiling_config=QUICK
        )
    )
    graph = graph_report(ait.tune(model, data(2, 4)))
    assert statuses(graph) == [("toy_wrong", "failed"), ("toy", "selected")]


def test_diagnostic_mode_measures_eager_but_does_not_gate(toy_backends):
    strategy = ait.MaxThroughputStrategy(backends=[ToyBackend(SLOW)], profiling_config=QUICK)
    strategy.enable_performance_validation(ait.PerformanceValidationMode.DIAGNOSTIC)
    model = wrap(strategy)
    graph = graph_report(ait.tune(model, data(2, 4)))
    assert graph.eager_profiles and graph.candidates[0].speedup < 1.0
    assert model.state == "tuned"


def test_min_latency_always_profiles_at_batch_one(toy_backends):
    config = ProfilingConfig(batch_sizes=[4, 8], measurement_stop_strategy=QUICK.measurement_stop_strategy)
    model = wrap(ait.MinLatencyStrategy(backends=[ToyBackend(FAST)], profiling_config=config))
    graph = graph_report(ait.tune(model, data(1, 4, 8)))
    assert [p.batch_size for p in graph.candidates[0].profiles] == [1]
    assert [p.batch_size for p in graph.eager_profiles] == [1]
    assert graph.decision == "toy"


def test_latency_budget_picks_the_best_batch_within_budget(toy_backends):
    # latency = 1 ms + 0.25 ms per row, so throughput grows with the batch and the budget bites
    module = SlowModule(delay_s=0.001, per_row_s=0.00025)
    strategy = ait.LatencyBudgetStrategy(
        latency_budget_ms=2.0, backends=[ToyBackend(ToyConfig(speed=0.5))], profiling_config=QUICK
    )
    model = ait.Module(module.eval(), "budget", strategy=strategy)
    report = ait.tune(model, data(1, 2), batch_sizes=[1, 2, 4, 8, 16])
    graph = graph_report(report)
    chosen = graph.candidates[0]
    assert graph.decision == "toy"
    assert graph.selected_batch_size == 8  # at speed 0.5: 1.5 ms at 8 rows (within 2 ms), 2.5 ms at 16 (over)
    assert all(p.batch_size in (1, 2, 4, 8, 16) for p in chosen.profiles)


def test_latency_budget_raises_when_no_backend_meets_it(toy_backends):
    strategy = ait.LatencyBudgetStrategy(latency_budget_ms=0.5, backends=[ToyBackend(SLOW)], profiling_config=QUICK)
    model = wrap(strategy)
    with pytest.raises(TuningError, match="no backend stays within the latency budget of 0.5 ms"):
        ait.tune(model, data(2, 4))


def test_strategies_reject_non_backends():
    with pytest.raises(TypeError, match="takes Backend objects"):
        ait.FirstWinsStrategy(backends=["tensorrt"])


def test_per_batch_size_routes_each_batch_range_to_its_fastest_backend(toy_backends, register_plugin):
    # at batch 1 the "small" backend wins, at 8 and 32 the "large" one; eager never wins
    def clock(name, batch):
        table = {
            "torch_eager": {1: 2.0, 8: 8.0, 32: 30.0},
            "toy": {1: 0.5, 8: 6.0, 32: 25.0},
            "toy_small": {1: 0.5, 8: 6.0, 32: 25.0},
        }
        return table[name][batch]

    from aitune import hookimpl
    from aitune.torch.task.profiling import summarize

    class Clock:
        @hookimpl
        def aitune_profile(self, runners, batch_size, config, device):
            out = {}
            for key in runners:
                name, index = key.split("#")
                ms = clock(name, batch_size)
                if index == "2":  # the second candidate: fast at large batches only
                    ms = {1: 1.5, 8: 2.0, 32: 5.0}[batch_size]
                out[key] = summarize([ms] * 4, batch_size, 1)
            return out

    register_plugin(Clock())
    small, large = ToyBackend(ToyConfig(speed=0.1)), ToyBackend(ToyConfig(speed=0.2))
    strategy = ait.MaxThroughputStrategy(backends=[small, large], profiling_config=QUICK, per_batch_size=True)
    model = wrap(strategy)
    report = ait.tune(model, data(1, 32), batch_sizes=[1, 8, 32])
    graph = graph_report(report)
    assert [(r.batch_min, r.batch_max) for r in graph.routes] == [(1, 2), (3, 32)]
    assert [c.status for c in graph.candidates] == ["selected", "selected"]
    routes = [(g.batch.min, g.batch.max, b.config.speed) for g, b in model.tuned_graphs]
    assert routes == [(1, 2, 0.1), (3, 32, 0.2)]
    x = torch.randn(2, 8)
    torch.testing.assert_close(model(x), model.module(x))
    assert model.tuned_graphs[0][1].calls > 0
    assert "for batch 1..2" in report.modules[0].summary


def test_per_batch_size_keeps_eager_where_nothing_beats_it(toy_backends, register_plugin, tmp_path):
    from aitune import hookimpl
    from aitune.torch.task.profiling import summarize

    class Clock:
        @hookimpl
        def aitune_profile(self, runners, batch_size, config, device):
            eager = {1: 1.0, 32: 30.0}[batch_size]
            toy = {1: 2.0, 32: 10.0}[batch_size]  # slower than eager at 1, faster at 32
            return {k: summarize([eager if k.startswith("torch_eager") else toy] * 4, batch_size, 1) for k in runners}

    register_plugin(Clock())
    strategy = ait.MaxThroughputStrategy(backends=[ToyBackend()], profiling_config=QUICK, per_batch_size=True)
    model = wrap(strategy)
    graph = graph_report(ait.tune(model, data(1, 32), batch_sizes=[1, 32]))
    assert [(r.batch_min, r.batch_max, r.backend) for r in graph.routes] == [(1, 5, "torch_eager"), (6, 32, "toy")]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # an eager range is served eager silently
        model(torch.randn(1, 8))
        backend = model.tuned_graphs[1][1]
        before = backend.calls
        model(torch.randn(20, 8))
    assert backend.calls == before + 1
    saved = ait.save(model, tmp_path / "routes.ait")
    loaded = ait.load(ait.Module(SlowModule(), "toy-model"), saved)
    assert [(g.batch.min, g.batch.max, b.name) for g, b in loaded.tuned_graphs] == [
        (1, 5, "torch_eager"),
        (6, 32, "toy"),
    ]
    torch.testing.assert_close(loaded(torch.randn(20, 8)).shape, torch.Size([20, 8]))
