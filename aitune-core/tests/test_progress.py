"""Progress that speaks: each step logs its start, a heartbeat while it runs long, and where the time
went; ``time_budget`` bounds a tune. Time is scripted (a fake clock), never slept."""

from __future__ import annotations

import logging

import pytest
import torch
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune.engine import progress
from aitune.errors import InputError
from aitune.render import render_markdown
from aitune.testing.backends import ToyBackend, ToyConfig


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake_clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(progress, "clock", clock)
    return clock


def test_a_long_step_logs_a_line_every_interval_while_it_runs(fake_clock, caplog):
    step = progress.Step("m: build toy", "build")
    beats = iter([False, False, False, True])  # three intervals pass, then the step ends

    def wait(seconds):
        assert seconds == progress.HEARTBEAT_S
        done = next(beats)
        if not done:
            fake_clock.now += seconds
        return done

    with caplog.at_level(logging.INFO, logger="aitune"):
        progress.Heartbeat(step).run(wait)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "m: build toy: still running after 30 s",
        "m: build toy: still running after 60 s",
        "m: build toy: still running after 90 s",
    ]


def test_a_step_logs_its_start_and_end_and_counts_its_seconds_by_stage(fake_clock, caplog):
    tracker = progress.TuneProgress(False)
    with caplog.at_level(logging.INFO, logger="aitune"):
        with tracker.step("m: validate toy", "validate") as step:
            fake_clock.now += 2.5
        with pytest.raises(RuntimeError), tracker.step("m: build toy", "build"):
            fake_clock.now += 4.0
            raise RuntimeError("broken")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "m: validate toy ...",
        "m: validate toy done in 2.50 s",
        "m: build toy ...",
        "m: build toy failed in 4.00 s",
    ], "a short step has no heartbeat line"
    assert all(r.levelno == logging.INFO for r in caplog.records)
    assert step.seconds == 2.5 and dict(tracker.spent) == {"validate": 2.5, "build": 4.0}


class PricedBackend(ToyBackend):
    """A toy backend whose build takes ``BUILD_S`` seconds of the fake clock and costs ``build_cost``."""

    name = "toy"
    BUILD_S = 5.0
    clock: FakeClock | None = None

    def build(self, module, context):
        super().build(module, context)
        type(self).clock.now += self.BUILD_S


def _priced(name, cost, seconds, clock):
    return type(name, (PricedBackend,), {"name": name, "build_cost": cost, "BUILD_S": seconds, "clock": clock})


def test_a_time_budget_builds_the_cheapest_first_and_skips_the_rest_for_time(toy_backends, fake_clock):
    compiler = _priced("toy_compiler", 10.0, 50.0, fake_clock)
    cheap = _priced("toy_cheap", 1.0, 5.0, fake_clock)
    cheaper = _priced("toy_cheaper", 0.5, 5.0, fake_clock)
    strategy = ait.MaxThroughputStrategy(
        [compiler(ToyConfig()), cheap(ToyConfig()), cheaper(ToyConfig())],
        performance_validation=False,
        per_batch_size=False,
    )
    model = ait.Module(SlowModule(delay_s=0.0).eval(), "m", strategy=strategy)
    report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], time_budget=8, end_to_end=False)
    [graph] = report.modules[0].graphs
    assert [c.backend for c in graph.candidates] == ["toy_cheaper", "toy_cheap", "toy_compiler"], "cheapest first"
    assert {c.status for c in graph.candidates[:2]} == {"selected", "rejected"}, "both built, one chosen"
    assert graph.candidates[2].status == "skipped", "the budget (8 s) was spent after two 5 s builds"
    skipped = graph.candidates[2]
    assert skipped.reason.startswith("time budget: 10 s of 8 s spent before its turn"), skipped.reason
    assert [c.build_time_s for c in graph.candidates[:2]] == [5.0, 5.0]
    assert report.time_budget == 8 and report.time_spent["build"] == 10.0
    assert model.state == "tuned"
    text = render_markdown(report)
    assert "| time spent | build 10.0 s (time budget 8 s, 1 candidate(s) skipped) |" in text, text
    assert "| toy_compiler | skipped |" in text


def test_first_wins_keeps_the_users_order_under_a_budget(toy_backends, fake_clock):
    from aitune_testkit.doubles import WrongBackend

    wrong_compiler = type(
        "WrongCompiler",
        (PricedBackend, WrongBackend),
        {"name": "toy_wrong_compiler", "build_cost": 10.0, "BUILD_S": 50.0, "clock": fake_clock},
    )
    cheap = _priced("toy_cheap", 1.0, 5.0, fake_clock)
    strategy = ait.FirstWinsStrategy([wrong_compiler(ToyConfig()), cheap(ToyConfig())], performance_validation=False)
    model = ait.Module(SlowModule(delay_s=0.0).eval(), "m", strategy=strategy)
    report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], time_budget=8, end_to_end=False)
    [graph] = report.modules[0].graphs
    assert [(c.backend, c.status) for c in graph.candidates] == [
        ("toy_wrong_compiler", "failed"),
        ("toy_cheap", "skipped"),
    ]
    assert "toy_cheap: time budget: 50 s of 8 s spent" in report.modules[0].summary, report.modules[0].summary


@pytest.mark.parametrize("budget", [0, -1, "60", True])
def test_a_time_budget_must_be_positive_seconds(toy_backends, budget):
    with pytest.raises(InputError, match="time_budget must be a number of seconds > 0"):
        ait.tune(ait.Module(SlowModule(), "m"), [torch.randn(2, 8)], time_budget=budget)


class ExportingBackend(PricedBackend):
    """A priced toy whose build exports first: ``EXPORT_S`` of its ``BUILD_S`` seconds, as it states."""

    EXPORT_S = 0.0

    def build(self, module, context):
        super().build(module, context)
        if self.EXPORT_S:
            self.build_info["export_s"] = self.EXPORT_S


def test_the_report_breaks_tune_time_down_by_phase_and_candidate_and_the_parts_add_up(toy_backends, fake_clock):
    exporting = type(
        "Exporting", (ExportingBackend,), {"name": "toy_export", "BUILD_S": 5.0, "EXPORT_S": 2.0, "clock": fake_clock}
    )
    compiling = type("Compiling", (ExportingBackend,), {"name": "toy_compile", "BUILD_S": 4.0, "clock": fake_clock})
    strategy = ait.MaxThroughputStrategy(
        [exporting(ToyConfig()), compiling(ToyConfig())], performance_validation=False, per_batch_size=False
    )
    model = ait.Module(SlowModule(delay_s=0.0).eval(), "m", strategy=strategy)
    report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], end_to_end=False)
    spent, by = report.time_spent, report.time_by_candidate
    assert (spent["export"], spent["build"]) == (2.0, 7.0), "the stated export is taken out of the build"
    assert by["m: toy_export"]["export"] == 2.0 and by["m: toy_export"]["build"] == 3.0
    assert by["m: toy_compile"]["build"] == 4.0 and "export" not in by["m: toy_compile"]
    assert {"validate", "profile"} <= set(by["m: toy_export"]) and set(by) == {"m: toy_export", "m: toy_compile"}
    for stage in ("export", "build", "validate", "profile"):
        assert sum(s.get(stage, 0.0) for s in by.values()) == pytest.approx(spent[stage]), stage
    assert sum(spent.values()) == pytest.approx(report.duration_s, abs=0.01), "the phases add up to the total"
    assert report.duration_s == pytest.approx(9.0), "the scripted clock moved only in the builds"
    text = render_markdown(report)
    assert (
        "| time by candidate | m: toy_export 5.0 s (export 2.0, build 3.0); m: toy_compile 4.0 s (build 4.0) |" in text
    )


def test_a_profiling_session_charges_each_contender_its_share(fake_clock):
    tracker = progress.TuneProgress(False)
    with tracker.step("m: profile a, b, eager", "profile", ["m: a", "m: b", "m: torch_eager"]):
        fake_clock.now += 6.0
    tracker.charge("m: a", "export", 1.5)
    assert dict(tracker.spent) == {"profile": 6.0, "export": 1.5}
    assert {who: dict(s) for who, s in tracker.by_candidate.items()} == {
        "m: a": {"profile": 2.0, "export": 1.5},
        "m: b": {"profile": 2.0},
        "m: torch_eager": {"profile": 2.0},
    }


def test_a_cached_build_counts_as_build_not_as_the_export_it_was_made_with(toy_backends, fake_clock):
    exporting = type(
        "Exporting", (ExportingBackend,), {"name": "toy", "BUILD_S": 5.0, "EXPORT_S": 2.0, "clock": fake_clock}
    )
    data = [torch.randn(2, 8), torch.randn(4, 8)]
    module = SlowModule(delay_s=0.0).eval()
    reports = []
    for _ in range(2):
        strategy = ait.OneBackendStrategy(exporting(ToyConfig()), performance_validation=False)
        reports.append(ait.tune(ait.Module(module, "m", strategy=strategy), data, end_to_end=False))
    first, again = (r.time_by_candidate["m: toy"] for r in reports)
    assert first["export"] == 2.0 and first["build"] == 3.0
    assert reports[1].modules[0].graphs[0].candidates[0].from_cache, "the second tune loads the first one's build"
    assert "export" not in again and "export" not in reports[1].time_spent
