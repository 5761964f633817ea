"""The strategy rules of the product's guide, with toy backends of known speed and correctness."""

from __future__ import annotations

import typing
import warnings

import pytest
import torch
from aitune_testkit.doubles import MutatingBackend, NaNBackend, SlowModule, WrongBackend

import aitune.torch as ait
from aitune.errors import TuningError, ValidationError
from aitune.testing import assert_matches_eager
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

FAST = ToyConfig(speed=0.0)
SLOW = ToyConfig(speed=2.0)
pytestmark = pytest.mark.busy  # tuned on a busy machine: no test here may need to win a timing race

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=20, warmup=2, window=5), extend_s=0.0
)


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
    assert_matches_eager(model(x), model.module(x))
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
    assert_matches_eager(model(x), expected)


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
        backends=[ToyBackend(ToyConfig(speed=3.0)), ToyBackend(SLOW)], profiling_config=QUICK, per_batch_size=False
    ).enable_performance_validation(False)
    model = wrap(strategy)
    graph = graph_report(ait.tune(model, data(2, 4)))
    assert graph.eager_profiles == []
    assert [c.status for c in graph.candidates] == ["rejected", "selected"]


def _clock(latencies_ms: dict[str, list[float]]):
    """A profiling plugin that reports fixed per-window latencies: decisions without timing noise."""
    from aitune import hookimpl
    from aitune.profiling import summarize

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
    config = ProfilingConfig(
        batch_sizes=[4, 8], measurement_stop_strategy=QUICK.measurement_stop_strategy, extend_s=0.0
    )
    model = wrap(ait.MinLatencyStrategy(backends=[ToyBackend(FAST)], profiling_config=config))
    graph = graph_report(ait.tune(model, data(1, 4, 8)))
    assert [p.batch_size for p in graph.candidates[0].profiles] == [1]
    assert [p.batch_size for p in graph.eager_profiles] == [1]
    assert graph.decision == "toy"


def _per_row_clock(fixed_ms: dict[str, float], per_row_ms: dict[str, float]):
    """Like :func:`_clock`, with latencies that grow with the batch: ``fixed + per_row * batch``."""
    from aitune import hookimpl
    from aitune.profiling import summarize

    class Clock:
        @hookimpl
        def aitune_profile(self, runners, batch_size, config, device):
            def latency(name: str) -> float:
                backend = name.split("#")[0]
                return fixed_ms[backend] + per_row_ms[backend] * batch_size

            return {name: summarize([latency(name)] * 4, batch_size, 1) for name in runners}

    return Clock()


def test_latency_budget_picks_the_best_batch_within_budget(toy_backends, register_plugin):
    # eager: 1 ms + 0.25 ms per row, the candidate half that, so throughput grows with the batch and
    # the budget bites; scripted, so a busy machine cannot move a batch across the budget
    register_plugin(_per_row_clock({"torch_eager": 1.0, "toy": 0.5}, {"torch_eager": 0.25, "toy": 0.125}))
    strategy = ait.LatencyBudgetStrategy(
        latency_budget_ms=2.0, backends=[ToyBackend(ToyConfig(speed=0.5))], profiling_config=QUICK
    )
    model = ait.Module(SlowModule(delay_s=0.001, per_row_s=0.00025).eval(), "budget", strategy=strategy)
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
    from aitune.profiling import summarize

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
    assert_matches_eager(model(x), model.module(x))
    assert model.tuned_graphs[0][1].calls > 0
    assert "for batch 1..2" in report.modules[0].summary


def test_per_batch_size_keeps_eager_where_nothing_beats_it(toy_backends, register_plugin, tmp_path):
    from aitune import hookimpl
    from aitune.profiling import summarize

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


# -- one figure, paired baselines, recorded data (issue 18) --------------------------------------

NO_DISPATCH = ProfilingConfig(
    measurement_stop_strategy=QUICK.measurement_stop_strategy,
    dispatch_cost_ms=0.0,
    extend_s=0.0,
)


class SessionClock:
    """A profiling plugin with fixed per-window latencies chosen per runner, batch and session.

    ``table(name, index, batch, session)`` returns the window latencies of one runner; ``session``
    counts the profiling sessions (the noise probe excluded). Runners are called once each, so a
    backend that raises while profiled does so here too.
    """

    def __init__(self, table):
        self.table = table
        self.sessions = 0

    @property
    def plugin(self):
        from aitune import hookimpl
        from aitune.profiling import summarize

        clock = self

        class Clock:
            @hookimpl
            def aitune_profile(self, runners, batch_size, config, device):
                probe = any(k.endswith("#probe") for k in runners)
                if not probe:
                    clock.sessions += 1
                out = {}
                for key, run in runners.items():
                    name, index = key.split("#")
                    run()
                    ms = [1.0] * 4 if probe else clock.table(name, index, batch_size, clock.sessions)
                    out[key] = summarize(ms, batch_size, 1)
                return out

        return Clock()


def test_ranking_uses_the_robust_figure_not_the_outlier_dragged_mean(toy_backends, register_plugin):
    # the demo's case: candidate 1 has the lower median but three 4 ms outliers; candidate 2 is steady
    windows = {
        "0": [0.165] * 12,
        "1": [0.067] * 9 + [4.0] * 3,
        "2": [0.113] * 12,
    }
    register_plugin(SessionClock(lambda name, index, batch, session: windows[index]).plugin)
    strategy = ait.MaxThroughputStrategy(
        backends=[ToyBackend(ToyConfig(speed=0.1)), ToyBackend(ToyConfig(speed=0.2))], profiling_config=NO_DISPATCH
    )
    graph = graph_report(ait.tune(wrap(strategy), data(4, 4)))
    first, second = graph.candidates
    assert first.profiles[0].mean_ms > second.profiles[0].mean_ms
    assert [first.status, second.status] == ["selected", "rejected"]
    assert first.speedup > second.speedup, "the selected candidate shows the better figure"
    assert "not chosen over toy (" in second.reason
    assert first.speedup_low <= first.speedup <= first.speedup_high


def test_first_wins_pairs_each_candidate_with_the_eager_of_its_own_session(toy_backends, register_plugin):
    # session 1: eager 1 ms, candidate 1.5 ms (rejected); then the machine slows down:
    # session 2: eager 4 ms, candidate 3 ms, which is 1.33x faster than the eager it ran with
    def table(name, index, batch, session):
        if name == "torch_eager":
            return [1.0] * 4 if session == 1 else [4.0] * 4
        return [1.5] * 4 if session == 1 else [3.0] * 4

    register_plugin(SessionClock(table).plugin)
    strategy = ait.FirstWinsStrategy(
        backends=[ToyBackend(ToyConfig(speed=0.1)), ToyBackend(ToyConfig(speed=0.2))], profiling_config=NO_DISPATCH
    )
    graph = graph_report(ait.tune(wrap(strategy), data(4, 4)))
    assert [c.status for c in graph.candidates] == ["rejected", "selected"]
    assert graph.candidates[1].speedup == pytest.approx(4.0 / 3.0)
    assert len(graph.eager_profiles) == 1, "one eager baseline per batch size in the report"
    assert graph.eager_profiles[0].p50_ms == pytest.approx(4.0), "the one the winner was judged against"
    assert graph.candidates[1].profiles[0].baseline_p50_ms == pytest.approx(4.0)


class FlakyBackend(ToyBackend):
    """Correct on the recorded samples, then raises once it has been called a few more times."""

    name = "toy_flaky"

    def infer(self, *args, **kwargs):
        if self.calls >= 12:
            raise RuntimeError("toy runtime lost its context")
        return super().infer(*args, **kwargs)


def test_a_profiling_failure_costs_only_that_candidate(toy_backends):
    strategy = ait.MaxThroughputStrategy(
        backends=[FlakyBackend(FAST), ToyBackend(FAST)], profiling_config=QUICK, per_batch_size=False
    )
    model = wrap(strategy)
    report = ait.tune(model, data(2, 4))
    graph = graph_report(report)
    flaky, good = graph.candidates
    assert (flaky.status, flaky.stage) == ("failed", "profile")
    assert "lost its context" in flaky.reason
    assert good.status == "selected" and model.state == "tuned"


def test_first_wins_moves_on_after_a_profiling_failure(toy_backends):
    strategy = ait.FirstWinsStrategy(backends=[FlakyBackend(FAST), ToyBackend(FAST)], profiling_config=QUICK)
    graph = graph_report(ait.tune(wrap(strategy), data(2, 4)))
    assert [(c.status, c.stage) for c in graph.candidates] == [("failed", "profile"), ("selected", None)]


def test_one_backend_that_fails_while_profiled_falls_back_to_eager(toy_backends):
    model = wrap(ait.OneBackendStrategy(FlakyBackend(FAST), profiling_config=QUICK))
    graph = graph_report(ait.tune(model, data(2, 4)))
    assert model.state == "passthrough" and graph.decision == "torch_eager"
    assert (graph.candidates[0].status, graph.candidates[0].stage) == ("failed", "profile")
    assert "failed while profiled" in graph.reason


def test_dispatch_cost_is_charged_before_the_gate(toy_backends, register_plugin):
    # 1.02x faster than eager on its own; not once the wrapper's per-call cost is added
    register_plugin(_clock({"torch_eager": [2.0] * 4, "toy": [1.96] * 4}))
    passes = ait.OneBackendStrategy(ToyBackend(), profiling_config=NO_DISPATCH)
    assert graph_report(ait.tune(wrap(passes), data(4, 4))).decision == "toy"
    charged = ProfilingConfig(
        measurement_stop_strategy=QUICK.measurement_stop_strategy, dispatch_cost_ms=0.05, extend_s=0.0
    )
    graph = graph_report(ait.tune(wrap(ait.OneBackendStrategy(ToyBackend(), profiling_config=charged)), data(4, 4)))
    assert graph.decision == "torch_eager"
    assert graph.candidates[0].profiles[0].dispatch_ms == 0.05
    assert graph.candidates[0].profiles[0].p50_ms == pytest.approx(2.01)


def test_dispatch_cost_is_measured_through_the_dispatcher():
    from aitune.engine.figures import measure_dispatch_ms
    from aitune.graph import Sample, infer_graph

    samples = [Sample((x,)) for x in data(2, 4)]
    graph = infer_graph(samples, ("x",), None, None)
    cost = measure_dispatch_ms(graph, samples[0], repeats=3, calls=50)
    assert 0.0 < cost < 5.0


class ShapeSpy(ToyBackend):
    """Records the input shapes it is called with."""

    name = "toy_spy"
    seen: typing.ClassVar[list] = []

    def infer(self, *args, **kwargs):
        ShapeSpy.seen.append(tuple(args[0].shape))
        return super().infer(*args, **kwargs)


def test_profiling_rotates_through_every_recorded_sample_at_every_recorded_batch_size(toy_backends):
    ShapeSpy.seen = []
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 3, 8, generator=g), torch.randn(4, 5, 8, generator=g), torch.randn(4, 3, 8, generator=g)]
    strategy = ait.MaxThroughputStrategy(backends=[ShapeSpy(FAST)], profiling_config=QUICK, per_batch_size=False)
    report = ait.tune(wrap(strategy), inputs, end_to_end=False)  # only profiling's calls are counted
    graph = graph_report(report)
    assert [p.batch_size for p in graph.eager_profiles] == [2, 4], "every recorded batch size"
    profiled = set(ShapeSpy.seen[-20:])
    assert profiled == {(4, 3, 8), (4, 5, 8)}, "every recorded sequence length, batched to the size"
    assert any("batch 2" in line and "x[2, 5, 8]" in line for line in graph.profiled_inputs)
    assert "timed: batch 4" in render_markdown_text(report)


def render_markdown_text(report):
    from aitune.render import render_markdown

    return render_markdown(report)


def test_gate_strategies_profile_the_most_common_recorded_batch_size(toy_backends):
    model = wrap(ait.OneBackendStrategy(ToyBackend(FAST), profiling_config=QUICK))
    graph = graph_report(ait.tune(model, data(1, 8, 8, 4)))
    assert [p.batch_size for p in graph.eager_profiles] == [8]


def test_min_latency_without_a_batch_axis_says_so_and_uses_the_recorded_size(toy_backends):
    model = wrap(ait.MinLatencyStrategy(backends=[ToyBackend(FAST)], profiling_config=QUICK))
    graph = graph_report(ait.tune(model, data(4, 4)))
    assert [p.batch_size for p in graph.eager_profiles] == [4]
    assert any("no batch axis" in n for n in graph.notes)


def test_latency_budget_never_keeps_eager_over_budget_silently(toy_backends, register_plugin):
    # the backend is within the budget but not clearly faster than eager, which is over the budget
    register_plugin(_clock({"torch_eager": [2.0] * 4, "toy": [1.0, 1.0, 2.5, 2.6]}))
    strategy = ait.LatencyBudgetStrategy(latency_budget_ms=1.9, backends=[ToyBackend()], profiling_config=NO_DISPATCH)
    graph = graph_report(ait.tune(wrap(strategy), data(4, 4)))
    assert graph.decision == "toy"
    assert "eager is over the latency budget" in graph.reason


def test_latency_budget_raises_when_every_backend_fails(toy_backends):
    strategy = ait.LatencyBudgetStrategy(
        latency_budget_ms=100.0, backends=[WrongBackend(FAST)], profiling_config=NO_DISPATCH
    )
    with pytest.raises(TuningError, match="no backend stays within the latency budget"):
        ait.tune(wrap(strategy), data(2, 4))


def _per_size_clock(fast_at_large: dict[int, float]):
    def table(name, index, batch, session):
        eager = {1: 2.0, 8: 8.0, 32: 30.0}[batch]
        if name == "torch_eager":
            return [eager] * 4
        return [{1: 0.5, 8: 6.0, 32: 25.0}[batch] if index == "1" else fast_at_large[batch]] * 4

    return SessionClock(table).plugin


def test_per_batch_routing_is_the_default_where_it_pays(toy_backends, register_plugin):
    register_plugin(_per_size_clock({1: 1.5, 8: 2.0, 32: 5.0}))
    strategy = ait.MaxThroughputStrategy(
        backends=[ToyBackend(ToyConfig(speed=0.1)), ToyBackend(ToyConfig(speed=0.2))], profiling_config=NO_DISPATCH
    )
    graph = graph_report(ait.tune(wrap(strategy), data(1, 8, 32)))
    assert [(r.batch_min, r.batch_max) for r in graph.routes] == [(1, 2), (3, 32)]
    assert any("routing by batch size pays at batch 1" in n for n in graph.notes)
    assert any("MB more artifact size and memory" in n for n in graph.notes)


def test_per_batch_routing_stays_off_when_one_backend_wins_everywhere(toy_backends, register_plugin):
    register_plugin(_per_size_clock({1: 0.4, 8: 2.0, 32: 5.0}))
    strategy = ait.MaxThroughputStrategy(
        backends=[ToyBackend(ToyConfig(speed=0.1)), ToyBackend(ToyConfig(speed=0.2))], profiling_config=NO_DISPATCH
    )
    graph = graph_report(ait.tune(wrap(strategy), data(1, 8, 32)))
    assert graph.routes == [] and graph.decision == "toy"
    assert [c.status for c in graph.candidates] == ["rejected", "selected"]


def _lead_at_1_clock(ratios: tuple[float, ...]):
    """Backend 1 ahead of backend 2 at batch 1 by ``ratios`` window for window; backend 2 ahead at 8 and 32."""

    def table(name, index, batch, session):
        if name == "torch_eager":
            return [{1: 2.0, 8: 8.0, 32: 30.0}[batch]] * len(ratios)
        if batch == 1:
            return [1.0 / r for r in ratios] if index == "1" else [1.0] * len(ratios)
        return [{8: 6.0, 32: 25.0}[batch] if index == "1" else {8: 2.0, 32: 5.0}[batch]] * len(ratios)

    return SessionClock(table).plugin


def test_per_batch_routing_follows_a_steady_lead_even_when_one_window_in_three_goes_the_other_way(
    toy_backends, register_plugin
):
    register_plugin(_lead_at_1_clock((1.03, 1.03, 0.99, 1.03, 1.03, 0.99)))
    strategy = ait.MaxThroughputStrategy(
        backends=[ToyBackend(ToyConfig(speed=0.1)), ToyBackend(ToyConfig(speed=0.2))], profiling_config=NO_DISPATCH
    )
    graph = graph_report(ait.tune(wrap(strategy), data(1, 8, 32)))
    assert [(r.batch_min, r.batch_max) for r in graph.routes] == [(1, 2), (3, 32)]
    assert any("routing by batch size pays at batch 1" in n and "at 90% confidence over 6 paired windows" in n
               for n in graph.notes)  # fmt: skip


def test_per_batch_routing_keeps_one_winner_for_a_lead_inside_the_noise(toy_backends, register_plugin):
    register_plugin(_lead_at_1_clock((1.04, 0.96, 1.03, 0.97, 1.05, 0.95)))
    strategy = ait.MaxThroughputStrategy(
        backends=[ToyBackend(ToyConfig(speed=0.1)), ToyBackend(ToyConfig(speed=0.2))], profiling_config=NO_DISPATCH
    )
    graph = graph_report(ait.tune(wrap(strategy), data(1, 8, 32)))
    assert graph.routes == [] and graph.decision == "toy"
    assert "no batch size where another backend beats it" in graph.reason


def test_per_batch_size_false_forces_one_winner(toy_backends, register_plugin):
    register_plugin(_per_size_clock({1: 1.5, 8: 2.0, 32: 5.0}))
    strategy = ait.MaxThroughputStrategy(
        backends=[ToyBackend(ToyConfig(speed=0.1)), ToyBackend(ToyConfig(speed=0.2))],
        profiling_config=NO_DISPATCH,
        per_batch_size=False,
    )
    graph = graph_report(ait.tune(wrap(strategy), data(1, 8, 32)))
    assert graph.routes == [] and graph.selected_batch_size == 32


def test_a_noisy_machine_is_reported_before_timing(toy_backends, register_plugin, caplog):
    from aitune import hookimpl
    from aitune.profiling import summarize

    class Noisy:
        @hookimpl
        def aitune_profile(self, runners, batch_size, config, device):
            ms = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.6, 1.7]
            return {k: summarize(ms, batch_size, 1) for k in runners}

    register_plugin(Noisy())
    with caplog.at_level("WARNING", logger="aitune"):
        graph = graph_report(ait.tune(wrap(ait.OneBackendStrategy(ToyBackend(), profiling_config=QUICK)), data(4)))
    assert any("machine is noisy" in n and "--threads" in n for n in graph.notes)
    assert "machine is noisy" in caplog.text


def test_the_report_records_the_thread_settings(toy_backends):
    report = ait.tune(wrap(ait.OneBackendStrategy(ToyBackend(), profiling_config=QUICK)), data(4))
    env = report.environment
    assert env["threads"] == torch.get_num_threads()
    assert env["interop_threads"] == torch.get_num_interop_threads()
    assert "omp_wait_policy" in env


def test_the_selected_candidate_is_never_beaten_beyond_its_interval(toy_backends, register_plugin):
    """Property: on the figure the report shows, no candidate beats the selected one beyond the interval."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    latencies = {}
    register_plugin(SessionClock(lambda name, index, batch, session: latencies[index]).plugin)

    def windows(base):
        spikes = st.lists(st.sampled_from([1.0, 1.0, 1.0, 1.05, 0.95, 1.3, 20.0]), min_size=8, max_size=8)
        return spikes.map(lambda f: [base * x for x in f])

    runner = st.tuples(*(st.sampled_from([0.5, 0.9, 1.0, 1.1, 2.0]).flatmap(windows) for _ in range(4)))

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(runner)
    def check(timings):
        latencies.clear()
        latencies.update({str(i): t for i, t in enumerate(timings)})
        strategy = ait.MaxThroughputStrategy(
            backends=[ToyBackend(ToyConfig(speed=s)) for s in (0.1, 0.2, 0.3)], profiling_config=NO_DISPATCH
        )
        graph = graph_report(ait.tune(wrap(strategy), data(4, 4)))
        selected = [c for c in graph.candidates if c.status == "selected"]
        figure = selected[0].speedup if selected else 1.0
        for c in graph.candidates:
            assert c.speedup is not None and c.speedup_low <= c.speedup <= c.speedup_high
            if c.status == "rejected":
                assert c.speedup_low <= figure, (c, figure)

    check()


# -- candidates that cannot apply ---------------------------------------------------------------------


def test_a_variant_that_does_not_apply_is_listed_as_such_and_left_out_of_the_summary(toy_backends):
    from aitune_testkit.doubles import NotApplicableBackend

    from aitune.render import render_markdown

    strategy = ait.FirstWinsStrategy([NotApplicableBackend(FAST), WrongBackend(FAST)], performance_validation=False)
    report = ait.tune(wrap(strategy), data(2, 4))
    graph = graph_report(report)
    assert statuses(graph) == [("toy_not_applicable", "not applicable"), ("toy_wrong", "failed")]
    assert graph.candidates[0].reason == "the toy variant applies to no module, by design"
    summary = report.modules[0].summary
    assert "toy_wrong" in summary and "toy_not_applicable" not in summary, summary
    assert "| toy_not_applicable | not applicable (build) |" in render_markdown(report), "the detailed report shows it"


@pytest.mark.parametrize("strategy", [ait.FirstWinsStrategy, ait.MaxThroughputStrategy])
def test_a_module_no_candidate_applies_to_runs_eager_without_a_failure_line(toy_backends, strategy):
    from aitune_testkit.doubles import NotApplicableBackend

    model = wrap(strategy([NotApplicableBackend(FAST)], performance_validation=False))
    report = ait.tune(model, data(2, 4))
    assert model.state != "tuned" and report.modules[0].status == "eager"
    summary = report.modules[0].summary
    assert "toy_not_applicable" not in summary and "applies" in summary, summary
