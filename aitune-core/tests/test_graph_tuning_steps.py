"""Each step of graph tuning on its own (build, validate, profile, decide), on a tiny module.

The steps are what every strategy is made of: a build that fails must be recorded and never
raised, a wrong candidate must never pass validation, profiling must pair every candidate with
eager's round and go on without one that raises, and the decision must leave no candidate pending
and tell observers of each exactly once. Profiling here runs on a scripted clock: no test races a timer.
"""

from __future__ import annotations

import collections
from typing import Any

import attrs
import pytest
import torch
from aitune_testkit.doubles import FlatBackend, NotApplicableBackend, SlowModule, WrongBackend

from aitune import hookimpl
from aitune.engine.graph_tuning import BUILDS_AHEAD, NOISY_SPREAD, GraphTuning, Ledger, Route, Target, decide
from aitune.engine.graph_tuning import build as building
from aitune.engine.graph_tuning.candidate import Candidate
from aitune.engine.graph_tuning.profile import Profiler
from aitune.engine.graph_tuning.validate import Validator
from aitune.engine.options import AccuracyRule
from aitune.engine.progress import TuneProgress
from aitune.graph import Sample, infer_graph
from aitune.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig, summarize
from aitune.report import CandidateReport, GraphReport, ProfileResult
from aitune.testing.backends import ToyBackend, ToyConfig

CONFIG = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=4, warmup=0, window=1),
    dispatch_cost_ms=0.0,
    extend_s=0.0,
)


class Observer:
    """Counts what observers hear: each candidate's result and each build error."""

    def __init__(self) -> None:
        self.results: collections.Counter[str] = collections.Counter()
        self.build_errors: list[str] = []

    @hookimpl
    def aitune_candidate_result(self, candidate: CandidateReport) -> None:
        self.results[candidate.backend + (f" ({candidate.variant})" if candidate.variant else "")] += 1

    @hookimpl
    def aitune_build_error(self, backend: Any, error: BaseException) -> None:
        self.build_errors.append(f"{backend.name}: {error}")


class Clock:
    """Profiling on a scripted clock: every runner is called once (so one that raises raises), and
    each answers the latencies scripted for its backend."""

    def __init__(self, latencies_ms: dict[str, list[float]]) -> None:
        self.latencies_ms = latencies_ms
        self.rounds: list[tuple[int, list[str]]] = []

    @hookimpl
    def aitune_profile(self, runners: dict[str, Any], batch_size: int) -> dict[str, ProfileResult]:
        self.rounds.append((batch_size, list(runners)))
        for run in runners.values():
            if getattr(run, "prepare", None) is not None:
                run.prepare()
            run()
        return {key: summarize(self.latencies_ms[key.split("#")[0]], batch_size, 1) for key in runners}


class OutOfMemoryBackend(ToyBackend):
    """Correct, and out of memory at any batch larger than 2."""

    name = "toy_oom"

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        if args[0].shape[0] > 2:
            raise torch.OutOfMemoryError("toy out of memory")
        return super().infer(*args, **kwargs)


@pytest.fixture
def observer(toy_backends: object, register_plugin: Any) -> Observer:
    return register_plugin(Observer(), name="observer")


@pytest.fixture
def session(observer: Observer, aitune_manager: Any) -> Any:
    return aitune_manager.session()


def target(session: Any, *batches: int, batch_sizes: tuple[int, ...] | None = None) -> Target:
    module = SlowModule(delay_s=0.0).eval()
    g = torch.Generator().manual_seed(0)
    samples = [Sample((torch.randn(b, 8, generator=g),)) for b in batches]
    with torch.no_grad():
        outputs = [module(*s.args) for s in samples]
    graph = infer_graph(samples, ["x"], None, batch_sizes, outputs)
    return Target(
        module_name="toy-model",
        module=module,
        graph=graph,
        samples=samples,
        device=torch.device("cpu"),
        session=session,
        batch_sizes=batch_sizes,
    )


def ledger(session: Any, *batches: int, time_budget: float | None = None) -> Ledger:
    aim = target(session, *batches)
    return Ledger(aim, GraphReport(aim.graph.key, {}), TuneProgress(False, time_budget=time_budget))


def built(ledger: Ledger, backend: ToyBackend) -> Candidate:
    candidate = building.build(ledger, backend)
    assert candidate.ok, candidate.report.reason
    return candidate


# -- build ------------------------------------------------------------------------------------


def test_build_makes_a_fresh_copy_with_a_pending_report_entry(session, observer):
    books = ledger(session, 2, 4)
    template = ToyBackend(ToyConfig(speed=0.5))
    candidate = building.build(books, template)
    assert candidate.ok and candidate.backend is not template and template.module is None
    assert books.report.candidates == [candidate.report] and books.built == [candidate]
    assert candidate.report.status == "pending" and candidate.report.config["speed"] == 0.5
    assert (
        candidate.report.build_time_s is not None and candidate.report.build_info["built_for"] == books.target.graph.key
    )
    assert "build" in books.progress.by_candidate["toy-model: toy"]
    assert not observer.results  # complete only once profiled or decided


def test_a_build_that_raises_is_recorded_not_raised_and_heard_once(session, observer):
    books = ledger(session, 2)
    candidate = building.build(books, ToyBackend(ToyConfig(fail_build=True)))
    assert not candidate.ok and isinstance(candidate.error, RuntimeError)
    assert (candidate.report.status, candidate.report.stage) == ("failed", "build")
    assert candidate.report.reason == "RuntimeError: toy compiler crashed on purpose"
    assert observer.build_errors == ["toy: toy compiler crashed on purpose"]
    decide.finish(books, building.eager(books.target), None, "eager", None)
    assert observer.results == {"toy": 1}


def test_a_backend_that_does_not_apply_is_no_build_error(session, observer):
    books = ledger(session, 2)
    candidate = building.build(books, NotApplicableBackend())
    assert (candidate.report.status, candidate.report.stage) == ("not applicable", "build")
    assert not candidate.ok and not observer.build_errors and observer.results == {"toy_not_applicable": 1}


def test_nothing_is_built_once_the_time_budget_is_spent(session, observer):
    books = ledger(session, 2, time_budget=1e-9)
    candidate = building.build(books, ToyBackend())
    assert candidate.report.status == "skipped" and "budget" in (candidate.report.reason or "")
    assert candidate.backend.module is None and observer.results == {"toy": 1}


def test_a_builds_seconds_are_split_as_the_backend_states_them(session):
    books = ledger(session, 2)
    candidate = Candidate(ToyBackend(), CandidateReport("toy", {}))
    candidate.backend.build_info.update(export_s=0.3, wait_s=0.5)
    building.charge(books, candidate, 1.0)
    assert books.progress.by_candidate["toy-model: toy"] == pytest.approx({"export": 0.3, "waiting": 0.5, "build": 0.2})
    cached = Candidate(ToyBackend(), CandidateReport("toy", {}, variant="cached"))
    cached.backend.build_info.update(export_s=0.3, from_cache=True)  # a hit only loaded
    building.charge(books, cached, 1.0)
    assert books.progress.by_candidate["toy-model: toy (cached)"] == {"build": 1.0}
    odd = Candidate(ToyBackend(), CandidateReport("toy", {}, variant="odd"))
    odd.backend.build_info.update(export_s=float("nan"), wait_s=5.0)  # not a number; more than it took
    building.charge(books, odd, 1.0)
    assert books.progress.by_candidate["toy-model: toy (odd)"] == {"waiting": 1.0, "build": 0.0}


def test_with_a_time_budget_the_cheapest_builds_go_first():
    class Costly(ToyBackend):
        build_cost = 10.0

    first, costly, last = ToyBackend(), Costly(), ToyBackend(ToyConfig(speed=2.0))
    assert building.order([costly, first, last], TuneProgress(False)) == [costly, first, last]
    assert building.order([costly, first, last], TuneProgress(False, time_budget=60)) == [first, last, costly]


# -- validate ----------------------------------------------------------------------------------


def validator(books: Ledger, accuracy: AccuracyRule | None = None) -> Validator:
    return Validator(books, None, None, accuracy or AccuracyRule())


def test_a_correct_candidate_passes_and_a_wrong_one_fails_at_validate(session, observer):
    books = ledger(session, 2, 4)
    check = validator(books)
    good, wrong = built(books, ToyBackend()), built(books, WrongBackend())
    assert check.validate(good) and good.ok and good.report.validation.passed
    assert good.report.validate_time_s is not None
    assert not check.validate(wrong) and not wrong.ok
    assert (wrong.report.status, wrong.report.stage) == ("failed", "validate")
    assert observer.results == {"toy_wrong": 1}


def test_the_users_metric_decides_instead_of_the_numeric_bound(session):
    books = ledger(session, 2, 4)
    lenient = validator(books, AccuracyRule(lambda tuned, eager, sample: 0.99, budget=0.05))
    wrong = built(books, WrongBackend())
    assert lenient.validate(wrong) and wrong.ok and wrong.report.metric == pytest.approx(0.99)
    assert any("accepted by the metric" in line for line in wrong.report.validation.checks)
    strict = validator(books, AccuracyRule(lambda tuned, eager, sample: 0.9, budget=0.05))
    rejected = built(books, ToyBackend())
    assert not strict.validate(rejected) and "below 0.95 (1 - accuracy_budget)" in rejected.report.reason
    nan = validator(books, AccuracyRule(lambda tuned, eager, sample: float("nan")))
    meaningless = built(books, ToyBackend())
    assert not nan.validate(meaningless) and "measures nothing" in meaningless.report.reason


# -- profile -----------------------------------------------------------------------------------


def profiler(books: Ledger) -> Profiler:
    return Profiler(books, building.eager(books.target), None)


def test_every_candidate_is_paired_with_the_eager_windows_of_its_own_round(session, register_plugin, observer):
    clock = register_plugin(Clock({"torch_eager": [2.0] * 4, "toy": [1.0] * 4, "toy_flat": [1.5] * 4}), name="clock")
    books = ledger(session, 2, 4)
    timing = profiler(books)
    fast, flat = built(books, ToyBackend()), built(books, FlatBackend())
    assert timing.profile([fast, flat], CONFIG, True, [2, 4]) == [2, 4]
    assert [size for size, _ in clock.rounds] == [2, 2, 4]  # the noise probe, then one round per size
    assert clock.rounds[1][1] == ["torch_eager#0", "toy#1", "toy_flat#2"]
    for candidate, p50 in ((fast, 1.0), (flat, 1.5)):
        assert [(p.batch_size, p.p50_ms, p.baseline_p50_ms) for p in candidate.report.profiles] == [
            (2, p50, 2.0),
            (4, p50, 2.0),
        ]
    assert [p.batch_size for p in books.report.eager_profiles] == [2, 4]
    assert books.report.profiled_inputs[0] == "batch 2: x[2, 8] (2 recorded samples, rotated)"
    assert observer.results == {"toy": 1, "toy_flat": 1}  # complete once profiled


def test_a_candidate_that_raises_while_profiled_fails_and_the_others_go_on(session, register_plugin):
    register_plugin(Clock({"torch_eager": [2.0] * 4, "toy": [1.0] * 4}), name="clock")
    books = ledger(session, 2, 4)
    small, steady = built(books, ToyBackend(ToyConfig(max_batch=2))), built(books, ToyBackend())
    assert profiler(books).profile([small, steady], CONFIG, True, [2, 4]) == [2, 4]
    assert (small.report.status, small.report.stage) == ("failed", "profile")
    assert small.report.reason.startswith("raised while profiled at batch 4: RuntimeError: toy backend supports")
    assert [p.batch_size for p in small.report.profiles] == [2]
    assert [p.batch_size for p in steady.report.profiles] == [2, 4]


def test_out_of_memory_ends_the_sweep_and_keeps_what_was_measured(session, register_plugin, tmp_path):
    register_plugin(Clock({"torch_eager": [2.0] * 4, "toy_oom": [1.0] * 4}), name="clock")
    books = ledger(session, 2, 4)
    candidate = Candidate(OutOfMemoryBackend(), CandidateReport("toy_oom", {}))
    candidate.backend.build(books.target.module, books.target.build_context(tmp_path))
    assert profiler(books).profile([candidate], CONFIG, True, [2, 4, 8]) == [2]
    assert candidate.ok and [p.batch_size for p in candidate.report.profiles] == [2]


def test_a_noisy_machine_is_noted_once_before_profiling(session, register_plugin):
    slow = 1.0 + 5 * NOISY_SPREAD  # eager's p90 far above its p50
    clock = register_plugin(Clock({"torch_eager": [1.0] * 7 + [slow] * 3, "toy": [0.5] * 10}), name="clock")
    books = ledger(session, 2)
    timing = profiler(books)
    candidate = built(books, ToyBackend())
    timing.profile([candidate], CONFIG, True, [2])
    timing.profile([candidate], CONFIG, True, [2])
    # probed before the first profile only, twice: the second probe confirms what the first saw
    assert [keys for _, keys in clock.rounds].count(["torch_eager#probe"]) == 2
    assert [n.startswith("the machine is noisy") for n in books.report.notes] == [True]


def test_a_quiet_machine_is_not_called_noisy(session, register_plugin):
    clock = register_plugin(Clock({"torch_eager": [1.0] * 10, "toy": [0.5] * 10}), name="clock")
    books = ledger(session, 2)
    profiler(books).profile([built(books, ToyBackend())], CONFIG, True, [2])
    assert books.report.notes == []
    assert [keys for _, keys in clock.rounds].count(["torch_eager#probe"]) == 1


def test_first_calls_that_still_speed_up_are_not_called_noise(session, register_plugin):
    """A model's first calls after recording speed up call by call on a quiet machine: the first probe
    sees a spread, the second (warm) one none, and nothing is said."""

    class WarmingUp(Clock):
        probes = 0

        @hookimpl
        def aitune_profile(self, runners: dict[str, Any], batch_size: int) -> dict[str, ProfileResult]:
            if list(runners) == ["torch_eager#probe"]:
                self.probes += 1
                warming = [2.5, 1.6, 1.5, 1.3, 1.2, 1.2, 1.2, 1.2, 1.1, 1.1]
                return {"torch_eager#probe": summarize(warming if self.probes == 1 else [1.1] * 10, batch_size, 1)}
            return super().aitune_profile(runners, batch_size)

    clock = register_plugin(WarmingUp({"torch_eager": [1.0] * 10, "toy": [0.5] * 10}), name="clock")
    books = ledger(session, 2)
    profiler(books).profile([built(books, ToyBackend())], CONFIG, True, [2])
    assert clock.probes == 2 and books.report.notes == []


def test_nothing_is_timed_while_builds_submitted_ahead_run(session, register_plugin):
    class Builds:
        def __init__(self) -> None:
            self.running = True

        def pending(self) -> bool:
            return self.running

        def wait_idle(self) -> None:
            self.running = False

    clock = register_plugin(Clock({"torch_eager": [2.0] * 4, "toy": [1.0] * 4}), name="clock")
    builds = Builds()
    books = ledger(attrs.evolve(session, builds=builds), 2)
    candidate = built(books, ToyBackend())
    profiler(books).profile([candidate], CONFIG, True, [2])
    assert not builds.running and clock.rounds
    assert list(books.progress.by_candidate[BUILDS_AHEAD]) == ["waiting"]  # charged to them, not a candidate


# -- decide ------------------------------------------------------------------------------------


def test_a_decision_leaves_nothing_pending_and_tells_observers_of_each_once(session, observer):
    books = ledger(session, 2)
    eager = building.eager(books.target)
    winner = built(books, ToyBackend())
    built(books, ToyBackend(ToyConfig(speed=2.0)))
    decide.finish(books, eager, winner, "fastest", 2)
    assert [c.status for c in books.report.candidates] == ["selected", "rejected"]
    assert (books.report.decision, books.report.reason, books.report.selected_batch_size) == ("toy", "fastest", 2)
    assert observer.results == {"toy": 2}
    decide.finish(books, eager, None, "again", None)  # told once, whatever is decided later
    assert observer.results == {"toy": 2} and books.report.decision == "torch_eager"


def test_two_variants_of_one_backend_serving_two_ranges_read_apart_in_the_decision(session):
    books = ledger(session, 1, 8)
    eager = building.eager(books.target)
    first = Candidate(ToyBackend(), CandidateReport("toy", {}, variant="torchscript export"))
    second = Candidate(ToyBackend(), CandidateReport("toy", {}, variant="eager attention"))
    decide.finish_routes(books, eager, [Route(1, 2, first), Route(3, 8, second)], "per size")
    assert books.report.decision == "toy (torchscript export) (batch 1..2), toy (eager attention) (batch 3..8)"
    assert [r.backend for r in books.report.routes] == ["toy", "toy"], "the routes keep the backend's name"


def test_routes_are_recorded_as_batch_ranges(session):
    books = ledger(session, 1, 8)
    eager = building.eager(books.target)
    dynamic = built(books, ToyBackend())
    static = Candidate(ToyBackend(), CandidateReport("toy", {}, static_batch=1))
    decide.finish_routes(books, eager, [Route(1, 1, static), Route(2, 4, dynamic), Route(5, 8, None)], "per size")
    assert books.report.decision == "toy static (batch 1..1), toy (batch 2..4), torch_eager (batch 5..8)"
    assert [(r.backend, r.static) for r in books.report.routes] == [
        ("toy", True),
        ("toy", False),
        ("torch_eager", False),
    ]
    assert dynamic.report.status == static.report.status == "selected"
    assert books.report.reason == "per size" and books.report.selected_batch_size is None


def test_the_figures_shown_are_each_candidates_against_its_paired_eager(session):
    books = ledger(session, 2)
    paired, unpaired = built(books, ToyBackend()), built(books, ToyBackend(ToyConfig(speed=2.0)))
    paired.report.profiles.append(
        attrs.evolve(summarize([1.0] * 4, 2, 1), baseline_p50_ms=2.0, baseline_window_p50_ms=[2.0] * 4)
    )
    unpaired.report.profiles.append(summarize([4.0] * 4, 2, 1))
    assert decide.versus_eager(books.report, unpaired, 2) is None  # no eager timed at all
    books.report.eager_profiles.append(summarize([3.0] * 4, 2, 1))
    assert decide.versus_eager(books.report, paired, 2).speedup == pytest.approx(2.0)  # its own round's eager
    assert decide.versus_eager(books.report, unpaired, 2).speedup == pytest.approx(0.75)
    decide.annotate(books, 2, max_noise=0.1)
    assert (paired.report.speedup, paired.report.measured) == (pytest.approx(2.0), True)
    decide.annotate(books, None, max_noise=0.1)
    assert paired.report.speedup is None and paired.report.measured is None


def test_failures_name_the_failed_and_the_skipped_but_not_what_does_not_apply(session):
    books = ledger(session, 2, time_budget=None)
    building.build(books, ToyBackend(ToyConfig(fail_build=True)))
    building.build(books, NotApplicableBackend())
    books.progress.time_budget = 1e-9
    building.build(books, ToyBackend())
    assert decide.failures(books.report) == (
        "toy: RuntimeError: toy compiler crashed on purpose; toy skipped: the time budget was spent"
    )


# -- the target and the tuning that holds the steps ----------------------------------------------


def test_the_batch_sizes_profiled_come_from_the_config_then_tune_then_the_recording(session):
    recorded = target(session, 2, 4, 4, 2)
    assert recorded.default_batch_sizes(ProfilingConfig()) == [4]  # the most common; ties: the larger
    assert recorded.default_batch_sizes(ProfilingConfig(), every_recorded=True) == [2, 4]
    assert recorded.default_batch_sizes(ProfilingConfig(batch_sizes=[3, 64])) == [3]  # only those inside
    asked = target(session, 2, 4, batch_sizes=(1, 8))
    assert asked.default_batch_sizes(ProfilingConfig()) == [1, 8]


def test_a_pinned_target_holds_the_calls_of_its_size_or_batches_made_to_it(session):
    aim = target(session, 2, 4, 2)
    two = aim.pinned(2)
    assert (two.graph.batch.min, two.graph.batch.max, two.static_batch) == (2, 2, 2)
    assert two.samples == [aim.samples[0], aim.samples[2]]
    three = aim.pinned(3)
    assert [s.args[0].shape[0] for s in three.samples] == [3, 3, 3]
    assert torch.equal(three.samples[0].args[0], torch.cat([aim.samples[0].args[0], aim.samples[1].args[0][:1]]))


def test_a_pinned_tuning_writes_into_the_graphs_report_but_lists_its_own_builds(session):
    aim = target(session, 2, 4)
    tuning = GraphTuning(
        module_name=aim.module_name,
        module=aim.module,
        graph=aim.graph,
        samples=aim.samples,
        device=aim.device,
        session=session,
        batch_sizes=None,
        tolerances=None,
        report=GraphReport(aim.graph.key, {}),
    )
    dynamic = tuning.build(ToyBackend())
    pinned = tuning.pinned(4)
    static = pinned.build(ToyBackend())
    assert static.static_batch == 4 and static.report.variant == "static batch 4"
    assert pinned.validate(static) and static.report.validation.passed
    assert tuning.report.candidates == [dynamic.report, static.report]
    assert tuning.built == [dynamic] and pinned.built == [static]
    assert pinned.report is tuning.report and pinned.eager is tuning.eager
    assert tuning.graph.batch.max == 4 and pinned.graph.batch.min == 4
