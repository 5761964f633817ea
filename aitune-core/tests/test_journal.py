"""The tuning journal: an interrupted ``ait.tune`` leaves its progress, and a rerun reuses the builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune.builtin.journal import journal_path, partial_report
from aitune.errors import InputError
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5), extend_s=0.0
)

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import aitune.torch as ait
    from aitune import hookimpl
    from aitune.plugins import get_manager
    from aitune.testing import backends
    from aitune_testkit.doubles import SlowModule
    from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

    class StallOnB:
        @hookimpl(wrapper=True)
        def aitune_build(self, backend, module, context):
            if context.module_name == "b" and os.environ.get("STALL"):
                open(os.environ["STALL"], "w").close()
                time.sleep(600)
            return (yield)

    manager = get_manager()
    manager.register(backends, name="aitune.testing.backends", distribution="aitune-core")
    manager.register(StallOnB(), name="stall")
    quick = ProfilingConfig(measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5), extend_s=0.0)
    a = ait.Module(SlowModule(), "a", strategy=ait.OneBackendStrategy(backends.ToyBackend(), profiling_config=quick))
    other = SlowModule()
    torch.nn.init.ones_(other.fc.bias)  # other weights: its own build, not a's
    b = ait.Module(other, "b", strategy=ait.OneBackendStrategy(backends.ToyBackend(), profiling_config=quick))
    report = ait.tune(lambda x: b(a(x)), [torch.randn(2, 8)], report_path=sys.argv[1])
    print("done", [m.status for m in report.modules])
    """
)


def test_a_killed_tune_leaves_its_progress_and_a_rerun_reuses_the_builds(tmp_path):
    script, report_path, marker = tmp_path / "tune.py", tmp_path / "out" / "report.json", tmp_path / "stalled"
    script.write_text(SCRIPT)
    env = {**os.environ, "STALL": str(marker)}
    proc = subprocess.Popen([sys.executable, str(script), str(report_path)], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the tuning subprocess never reached module b"
            time.sleep(0.1)
    finally:
        proc.kill()  # SIGKILL: no cleanup runs, as when the machine takes the process away
        proc.wait()
        proc.stderr.close()

    assert not report_path.exists(), "the run was killed before writing its report"
    partial = partial_report(report_path)
    assert [(m.name, m.status) for m in partial.modules] == [("a", "tuned")]
    (candidate,) = partial.modules[0].graphs[0].candidates
    assert candidate.backend == "toy" and candidate.status == "selected" and not candidate.from_cache

    env.pop("STALL")
    done = subprocess.run([sys.executable, str(script), str(report_path)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(report_path.read_text())
    from_cache = {m["name"]: m["graphs"][0]["candidates"][0]["from_cache"] for m in report["modules"]}
    assert from_cache == {"a": True, "b": False}, "a's build came back from the build cache"
    assert [m.status for m in partial_report(report_path).modules] == ["tuned", "tuned"]


def test_the_journal_sits_beside_the_report_and_ends_with_finished(toy_backends, tmp_path):
    model = ait.Module(
        SlowModule(), "m", strategy=ait.OneBackendStrategy(ToyBackend(ToyConfig()), profiling_config=QUICK)
    )
    ait.tune(model, [torch.randn(2, 8)], report_path=tmp_path / "report.json")
    path = journal_path(tmp_path / "report.json")
    assert path == tmp_path / "report.journal.jsonl"
    events = [json.loads(line)["event"] for line in path.read_text().splitlines()]
    assert events == ["started", "candidate", "module", "finished"]


def test_the_journal_is_closed_when_tune_raises(toy_backends, tmp_path, monkeypatch):
    closed = []
    monkeypatch.setattr(
        "aitune.builtin.journal.Journal.close", lambda self: closed.append(self.path) or self.file.close()
    )
    model = ait.Module(SlowModule(), "m", strategy=ait.OneBackendStrategy(ToyBackend(ToyConfig(fail_build=True))))
    with pytest.raises(Exception, match="toy compiler crashed on purpose"):
        ait.tune(model, [torch.randn(2, 8)], report_path=tmp_path / "report.json")
    path = journal_path(tmp_path / "report.json")
    assert closed == [path]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["event"] for line in lines] == ["started", "candidate", "failed"]
    assert "toy compiler crashed on purpose" in lines[-1]["error"]
    # the failed candidate was written when it failed, so what went wrong outlives the run
    (module,) = partial_report(path).modules
    assert module.status == "interrupted"
    (candidate,) = module.graphs[0].candidates
    assert (candidate.backend, candidate.status, candidate.stage) == ("toy", "failed", "build")


def test_no_report_path_no_journal(toy_backends, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = ait.Module(
        SlowModule(), "m", strategy=ait.OneBackendStrategy(ToyBackend(ToyConfig()), profiling_config=QUICK)
    )
    ait.tune(model, [torch.randn(2, 8)])
    assert list(tmp_path.iterdir()) == []


def test_a_torn_last_line_is_ignored_and_unfinished_modules_say_interrupted(tmp_path):
    candidate = {"backend": "toy", "config": {"backend": "toy"}, "status": "rejected"}
    lines = [
        {"event": "started", "device": "cpu"},
        {"event": "candidate", "module": "enc", "graph_key": "k", "candidate": candidate},
    ]
    path = tmp_path / "r.journal.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"event": "cand')
    report = partial_report(path)
    assert report.device == "cpu"
    assert [(m.name, m.status, m.graphs[0].candidates[0].backend) for m in report.modules] == [
        ("enc", "interrupted", "toy")
    ]


def test_a_missing_journal_says_where_it_looked(tmp_path):
    with pytest.raises(InputError, match="no tuning journal at .*report.journal.jsonl"):
        partial_report(tmp_path / "report.json")
