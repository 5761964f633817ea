"""The report as people read it (markdown, HTML) and the CLI around tuning."""

from __future__ import annotations

import copy
import html
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from aitune_testkit.doubles import SlowModule, WrongBackend
from typer.testing import CliRunner

import aitune.torch as ait
from aitune import hookimpl
from aitune.cli import app
from aitune.profiling import summarize
from aitune.render import render_html, render_markdown
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

pytestmark = pytest.mark.busy  # tuned on a busy machine: no test here may need to win a timing race

QUICK = ProfilingConfig(
    batch_sizes=[2, 4],
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5),
    extend_s=0.0,
)


@pytest.fixture(scope="module")
def tuned_report(tmp_path_factory):
    """One tune for the tests that only read its report (seconds each on a busy machine), run as
    every test here is: a cache of its own, the toy backends and the testkit's doubles registered
    (conftest.py's ``toy_backends``) and one core kept busy by another process (``busy_core``)."""
    from aitune_testkit import doubles

    from aitune.plugins import AituneManager, set_manager
    from aitune.testing import backends, fixtures

    manager = AituneManager()
    manager.load_entry_points()
    manager.register(backends, name="aitune.testing.backends", distribution="aitune-core")
    manager.register(doubles, name="aitune_testkit.doubles", distribution="aitune-testkit")
    previous = set_manager(manager)
    core = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    spinner = subprocess.Popen([sys.executable, "-c", fixtures._SPIN, str(core)])
    patch = pytest.MonkeyPatch()
    patch.setenv("AITUNE_CACHE_DIR", str(tmp_path_factory.mktemp("aitune-cache")))
    try:
        strategy = ait.MaxThroughputStrategy(
            backends=[ToyBackend(ToyConfig()), ToyBackend(ToyConfig(speed=2.0)), WrongBackend()],
            profiling_config=QUICK,
        )
        model = ait.Module(SlowModule(), "encoder", strategy=strategy)
        return ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
    finally:
        patch.undo()
        spinner.kill()
        spinner.wait()
        set_manager(previous)


@pytest.fixture
def report(tuned_report):
    """The module's tuned report, a copy of its own for each test (some change it)."""
    return copy.deepcopy(tuned_report)


def test_markdown_has_every_candidate_and_the_decision(report):
    text = render_markdown(report)
    assert "## encoder" in text and "Decision: **toy**" in text
    assert "| toy_wrong | failed (validate) |" in text
    assert "torch_eager (baseline)" in text
    assert "x: float32[batch, 8] with batch 2..4" in text
    selected = next(line for line in text.splitlines() if line.startswith("| toy | selected"))
    # timing decides which: a figure with its interval, or on a busy machine the bound it clears or "not measured"
    assert "x [" in selected or "(noise ±" in selected or "not measured: noise ±" in selected, selected
    assert "- timed: batch 2: x[2, 8]" in text and "- timed: batch 4: x[4, 8]" in text


class SteadyClock:
    """Profiles without a clock: eager 2 ms a call, the first candidate 1 ms, each next one 1 ms
    slower, in eight equal windows: a figure with a tight interval whatever the machine is doing."""

    @hookimpl
    def aitune_profile(self, runners, batch_size, config, device):
        latency = {key: 2.0 if i == 0 else float(i) for i, key in enumerate(runners)}
        return {key: summarize([ms] * 8, batch_size, 1) for key, ms in latency.items()}


def test_a_measured_speedup_is_shown_with_its_interval(toy_backends, register_plugin):
    register_plugin(SteadyClock())
    strategy = ait.MaxThroughputStrategy(backends=[ToyBackend(ToyConfig())], profiling_config=QUICK)
    model = ait.Module(SlowModule(), "encoder", strategy=strategy)
    text = render_markdown(ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], end_to_end=False))
    selected = next(line for line in text.splitlines() if line.startswith("| toy | selected"))
    # 2x less the measured per-call cost of the dispatcher, charged to the candidate (1.99x or 2.00x)
    assert re.search(r"\| (1\.9\d|2\.00)x \[(1\.9\d|2\.00)-(1\.9\d|2\.00)\] \|", selected), selected


@pytest.mark.parametrize(
    ("decided_by", "line"),
    [
        (0, "rank 1 of 2, decided on rank 0's figures"),
        ("slowest", "rank 1 of 2, decided on the slowest rank's figures"),
    ],
)
def test_a_ranks_report_says_whose_figures_decided(report, decided_by, line):
    report.environment["distributed"] = {"rank": 1, "world_size": 2, "decided_by": decided_by}
    assert line in render_markdown(report)
    assert html.escape(line) in render_html(report)


def test_a_single_process_report_has_no_ranks_line(report):
    assert "decided on" not in render_markdown(report)


def test_html_is_self_contained_with_inline_plots(report):
    page = render_html(report)
    assert page.startswith("<!doctype html>")
    assert page.count("<svg") == 2, "a latency plot and a throughput-vs-batch plot"
    for external in ('src="http', "src='http", 'href="http', "url(http", "<link", "<script", "@import"):
        assert external not in page, f"the page must load nothing from elsewhere: found {external}"
    assert "failed (validate)" in page and "Environment" in page


def test_report_command_reads_json_and_artifacts(report, tmp_path, toy_backends):
    report.save(tmp_path / "run.json")
    result = CliRunner().invoke(app, ["report", str(tmp_path / "run.json"), "--html", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r.html").read_text().count("<svg") == 2
    printed = CliRunner().invoke(app, ["report", str(tmp_path / "run.json")])
    assert printed.exit_code == 0 and "Decision: **toy**" in printed.output, "markdown is the default"


def test_report_command_reads_the_journal_of_an_interrupted_run(toy_backends, tmp_path):
    model = ait.Module(SlowModule(), "encoder", strategy=ait.OneBackendStrategy(ToyBackend(), profiling_config=QUICK))
    ait.tune(model, [torch.randn(2, 8)], report_path=tmp_path / "run.json")
    journal = tmp_path / "run.journal.jsonl"
    lines = journal.read_text().splitlines()
    cut = next(i for i, line in enumerate(lines) if json.loads(line)["event"] == "module")
    journal.write_text("\n".join(lines[:cut]) + "\n")  # as if killed after the candidate, before the module ended
    (tmp_path / "run.json").unlink()
    for source in (tmp_path / "run.json", journal):  # the report path the run was given, or the journal itself
        printed = CliRunner().invoke(app, ["report", str(source)])
        assert printed.exit_code == 0, printed.output
        assert "encoder" in printed.output and "interrupted" in printed.output
        assert "Decision: **not made: the run stopped first**" in printed.output
        assert "### graph 0: x: float32[2, 8]" in printed.output, "the journal keeps each graph's inputs"
    missing = CliRunner().invoke(app, ["report", str(tmp_path / "other.json")])
    assert missing.exit_code != 0 and "not a readable report" in missing.output


def test_artifact_carries_its_report(toy_backends, tmp_path):
    model = ait.Module(SlowModule(), "m", strategy=ait.OneBackendStrategy(ToyBackend(), profiling_config=QUICK))
    ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
    ait.save(model, tmp_path / "m.ait")
    result = CliRunner().invoke(app, ["report", str(tmp_path / "m.ait"), "--markdown"])
    assert result.exit_code == 0, result.output
    assert "## m" in result.output and "Decision: **toy**" in result.output


def test_tune_command_end_to_end(toy_backends, tmp_path, monkeypatch):
    (tmp_path / "factory_mod.py").write_text(
        textwrap.dedent(
            """
            import torch
            from aitune_testkit.doubles import SlowModule

            def make():
                return SlowModule().eval(), [torch.randn(2, 8), torch.randn(4, 8)]
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    result = CliRunner().invoke(
        app,
        [
            "tune",
            "factory_mod:make",
            "--strategy",
            "one-backend",
            "--backend",
            "toy",
            "--output",
            "out.ait",
            "--report",
            "out.json",
            "--html",
            "out.html",
            "--threads",
            "1",
            "--time-budget",
            "600",
        ],
        env={"COLUMNS": "200"},
    )
    torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out.json").read_text())["environment"]["threads"] == 1
    assert "SlowModule" in result.output and "tuned" in result.output
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["time_budget"] == 600 and saved["time_spent"]["build"] >= 0 and "recording" in saved["time_spent"]
    assert "time spent: " in result.output and "(time budget 600 s)" in result.output, "where the time went"
    assert json.loads((tmp_path / "out.json").read_text())["modules"][0]["graphs"][0]["decision"] == "toy"
    assert (tmp_path / "out.ait").stat().st_size > 0 and "<svg" in (tmp_path / "out.html").read_text()
    bad = CliRunner().invoke(app, ["tune", "nope"])
    assert bad.exit_code == 2 and "package.module:factory" in bad.output
    needs_one = CliRunner().invoke(app, ["tune", "factory_mod:make", "--strategy", "one-backend"])
    assert needs_one.exit_code == 2 and "exactly one --backend" in needs_one.output


def test_inspect_recommends_modules(tmp_path, monkeypatch):
    (tmp_path / "inspect_mod.py").write_text(
        textwrap.dedent(
            """
            import torch

            class Net(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.body = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
                    self.tail = torch.nn.Linear(256, 2)

                def forward(self, x):
                    return self.tail(self.body(x))

            def make():
                return Net().eval(), [torch.randn(64, 32)]
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["inspect", "inspect_mod:make", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    modules = data["modules"]
    assert modules["body"]["parameters"] == 32 * 256 + 256 + 256 * 256 + 256
    assert modules[""]["recommended"], "the whole model: most of the time, no graph breaks"
    assert not modules["body"]["recommended"], "nested inside a recommended module"


def test_inspect_prefers_children_of_a_module_with_graph_breaks():
    class Breaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))

        def forward(self, x):
            h = self.enc(x)
            if h.sum() > 0:  # data-dependent Python branch: a graph break
                h = h * 2
            return h

    for sign in (1.0, -1.0):  # the branch taken and not taken: after an untaken one no graph follows the break
        torch.manual_seed(0)
        model = Breaky().eval()
        x = torch.randn(64, 64)
        with torch.no_grad():
            model.enc[2].bias.fill_(10.0 * sign)  # the sum's sign, whatever the input
            assert (model.enc(x).sum() > 0) == (sign > 0), "the input takes the branch it is meant to"
        result = ait.inspect(model, [x])
        assert result.modules[""].graph_breaks >= 1 and not result.modules[""].recommended, sign
        assert result.recommended == ["enc"]
        assert "enc" in result.describe()
