"""Isolated builds and fault injection: what a user sees when a backend breaks.

Each fault backend of :mod:`aitune_testkit.faults` breaks in one way; tuning must go on, the
candidate must say why it failed, and the user's process must be unharmed.
"""

from __future__ import annotations

import logging
import os
import signal
import warnings

import pytest
import torch
from aitune_testkit import faults
from aitune_testkit.doubles import NaNBackend, SlowModule

import aitune.torch as ait
from aitune import executor, hookimpl
from aitune.builds import isolation
from aitune.errors import BuildError, ConfigError
from aitune.testing import assert_matches_eager
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5), extend_s=0.0
)


@pytest.fixture
def fault_backends(toy_backends, register_plugin):
    return register_plugin(faults, name="aitune_testkit.faults", distribution="aitune-testkit")


def _tune(*backends, report_path=None, batch_sizes=None, data=None, end_to_end=True):
    """Tune a SlowModule over ``backends`` (eager when they all fail); returns (model, report)."""
    model = ait.Module(
        SlowModule(), "m", strategy=ait.MaxThroughputStrategy(backends=list(backends), profiling_config=QUICK)
    )
    data = data if data is not None else [torch.randn(2, 8), torch.randn(4, 8)]
    report = ait.tune(model, data, batch_sizes=batch_sizes, report_path=report_path, end_to_end=end_to_end)
    return model, report


def _candidates(report):
    return {c.backend: c for c in report.modules[0].graphs[0].candidates}


# -- isolation settings ---------------------------------------------------------------------------


def test_isolation_mode_defaults_to_native_and_refuses_unknown_values(monkeypatch):
    monkeypatch.delenv("AITUNE_ISOLATE", raising=False)
    assert isolation.isolated(faults.SegfaultBackend()) and not isolation.isolated(ToyBackend())
    monkeypatch.setenv("AITUNE_ISOLATE", "all")
    assert isolation.isolated(ToyBackend())
    monkeypatch.setenv("AITUNE_ISOLATE", "none")
    assert not isolation.isolated(faults.SegfaultBackend())
    monkeypatch.setenv("AITUNE_ISOLATE", "sometimes")
    with pytest.raises(ConfigError, match="AITUNE_ISOLATE='sometimes' is not one of native, all, none"):
        isolation.isolated(ToyBackend())


def test_limits_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("AITUNE_BUILD_TIMEOUT_S", "12.5")
    monkeypatch.setenv("AITUNE_BUILD_MEMORY_MB", "3000")
    assert executor.timeout_s() == 12.5
    assert executor.memory_mb(torch.device("cpu")) == 3000
    monkeypatch.setenv("AITUNE_BUILD_MEMORY_MB", "0")
    assert executor.memory_mb(torch.device("cpu")) is None
    monkeypatch.delenv("AITUNE_BUILD_MEMORY_MB")
    assert executor.memory_mb(torch.device("cuda")) is None, "CUDA reserves more address space than any cap"
    assert executor.memory_mb(torch.device("cpu")) > 0
    monkeypatch.setenv("AITUNE_BUILD_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="AITUNE_BUILD_TIMEOUT_S='soon' must be a number"):
        executor.timeout_s()


# -- the happy path -------------------------------------------------------------------------------


def test_an_isolated_build_runs_in_a_worker_and_the_result_works(fault_backends):
    model, report = _tune(faults.IsolatedToyBackend())
    candidate = _candidates(report)["toy_isolated"]
    assert candidate.status == "selected", candidate.reason
    assert candidate.build_info["isolated"] is True
    x = torch.randn(3, 8)
    assert_matches_eager(model(x), model.module(x))


def test_a_cache_hit_skips_the_worker(fault_backends, monkeypatch):
    runs = []
    real = isolation.run_worker
    monkeypatch.setattr(isolation, "run_worker", lambda *a: runs.append(1) or real(*a))
    _tune(faults.IsolatedToyBackend())
    _, report = _tune(faults.IsolatedToyBackend())
    candidate = _candidates(report)["toy_isolated"]
    assert candidate.from_cache and runs == [1], "the second tune was answered by the build cache"
    assert candidate.build_info["isolated"] is True, "the cache keeps what the isolated build reported"


def test_a_backend_without_export_builds_in_process_even_when_isolating_all(toy_backends, monkeypatch):
    monkeypatch.setenv("AITUNE_ISOLATE", "all")
    _, report = _tune(ToyBackend(ToyConfig()))
    candidate = _candidates(report)["toy"]
    assert candidate.status == "selected" and "isolated" not in candidate.build_info


def test_isolation_off_builds_native_backends_in_process(fault_backends, monkeypatch):
    monkeypatch.setenv("AITUNE_ISOLATE", "none")
    _, report = _tune(faults.IsolatedToyBackend())
    candidate = _candidates(report)["toy_isolated"]
    assert candidate.status == "selected" and "isolated" not in candidate.build_info


# -- faults in the worker -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "cause", "text"),
    [
        (faults.SegfaultBackend, "crash", "crashed with SIGSEGV"),
        (faults.AbortBackend, "crash", "crashed with SIGABRT"),
        (faults.ExitBackend, "exit", "exited without a result (exit code 7)"),
        (faults.RaisingBackend, "error", "RuntimeError: the compiler rejected the graph on purpose"),
    ],
)
def test_a_worker_that_dies_costs_one_candidate(fault_backends, register_plugin, backend, cause, text):
    errors = []

    class Listener:
        @hookimpl
        def aitune_build_error(self, module_name, graph, backend, error):
            errors.append(error)

    register_plugin(Listener())
    model, report = _tune(backend(), ToyBackend(ToyConfig()))
    failed, other = _candidates(report)[backend.name], _candidates(report)["toy"]
    assert failed.status == "failed" and failed.stage == "build"
    assert text in failed.reason and "WorkerBuildError" in failed.reason
    assert other.status == "selected", "tuning went on with the next candidate"
    (error,) = errors
    assert isinstance(error, BuildError) and error.cause == cause
    if cause == "crash":
        assert "last lines of the worker's log" in failed.reason
        if backend is faults.AbortBackend:  # the cause, printed long before the log's last lines, is kept
            assert "what():  index out of bounds" in failed.reason and "frame #39" in failed.reason
        assert error.exit_code == -(signal.SIGSEGV if backend is faults.SegfaultBackend else signal.SIGABRT)
    assert model.state == "tuned"


def test_a_worker_failure_is_built_again_in_process_where_the_backend_says_so(fault_backends, caplog):
    """AOTInductor's case: the worker's build aborts, the in-process one works and is validated."""
    with caplog.at_level(logging.WARNING, logger="aitune"):
        model, report = _tune(faults.RetriedAbortBackend(ToyConfig(speed=0.1)))
    found = _candidates(report)["fault_abort_retried"]
    assert found.status == "selected", found.reason
    assert found.validation.passed and found.build_info["retried_in_process"] is True
    assert "what():  index out of bounds" in found.build_info["worker_failure"], "the worker's native error is kept"
    assert "building it in this process instead" in caplog.text
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert_matches_eager(model(x), model.module(x))


def test_a_build_stopped_at_the_time_limit_is_never_retried_in_process(fault_backends, monkeypatch):
    """A hang would hang the user's process too (its in-process build would work: the retry must not run)."""
    monkeypatch.setattr(faults.HangBackend, "retry_in_process", True)
    monkeypatch.setenv("AITUNE_BUILD_TIMEOUT_S", "6")
    _, report = _tune(faults.HangBackend())
    found = _candidates(report)["fault_hang"]
    assert found.status == "failed" and "did not finish within 6 s" in found.reason


def test_a_hanging_build_is_stopped_at_the_time_limit(fault_backends, monkeypatch):
    monkeypatch.setenv("AITUNE_BUILD_TIMEOUT_S", "6")
    _, report = _tune(faults.HangBackend())
    candidate = _candidates(report)["fault_hang"]
    assert candidate.status == "failed"
    assert (
        "did not finish within 6 s and was stopped; if the build is only slow, raise AITUNE_BUILD_TIMEOUT_S"
        in candidate.reason
    )
    assert report.modules[0].status == "eager"


def test_a_build_that_eats_memory_stops_at_the_cap(fault_backends, monkeypatch):
    monkeypatch.setenv("AITUNE_BUILD_MEMORY_MB", "2500")
    _, report = _tune(faults.MemoryHogBackend())
    candidate = _candidates(report)["fault_memory"]
    assert candidate.status == "failed"
    assert "ran out of memory (address-space cap 2500 MB, AITUNE_BUILD_MEMORY_MB)" in candidate.reason


# -- faults in the user's process -----------------------------------------------------------------


def test_a_backend_that_fails_at_inference_after_tuning_falls_back_to_eager(fault_backends):
    # no end-to-end timing: its calls would raise and run eager too, and whether eager plus a raise
    # is "slower beyond the interval" is a race on a busy machine (it once took the winner back)
    model, report = _tune(faults.InferFailBackend(), end_to_end=False)
    assert _candidates(report)["fault_infer"].status == "selected"
    x = torch.randn(3, 8)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="running this call eager: the tuned backend raised RuntimeError"):
            y = model(x)
        assert_matches_eager(y, model.module(x))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(x)  # warned once, not on every call


def test_a_backend_that_fails_at_inference_raises_in_strict_mode(fault_backends):
    model = ait.Module(
        SlowModule(),
        "m",
        strict=True,
        strategy=ait.MaxThroughputStrategy(backends=[faults.InferFailBackend()], profiling_config=QUICK),
    )
    ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
    with torch.no_grad(), pytest.raises(RuntimeError, match="lost its device context"):
        model(torch.randn(3, 8))


def test_a_backend_that_returns_nan_is_rejected_by_validation(toy_backends):
    model, report = _tune(NaNBackend())
    candidate = _candidates(report)["toy_nan"]
    assert candidate.status == "failed" and candidate.stage == "validate"
    assert "NaN/Inf values where eager is finite" in candidate.reason
    assert model.state == "passthrough"


def test_out_of_memory_while_profiling_keeps_what_was_measured(fault_backends, caplog):
    backend = faults.OutOfMemoryBackend(ToyConfig(max_batch=4))
    strategy = ait.MaxThroughputStrategy(
        backends=[backend],
        profiling_config=ProfilingConfig(
            batch_sizes=[2, 4, 16], measurement_stop_strategy=QUICK.measurement_stop_strategy, extend_s=0.0
        ),
    )
    model = ait.Module(SlowModule(), "m", strategy=strategy)
    with caplog.at_level(logging.WARNING, logger="aitune"):
        report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], batch_sizes=[16])
    assert "m: out of memory at batch 16; profiling stops there" in caplog.text
    candidate = _candidates(report)["fault_oom"]
    assert [p.batch_size for p in candidate.profiles] == [2, 4]
    assert candidate.status == "selected"


def test_a_plugin_that_fails_to_import_is_skipped_with_its_name(fake_distribution, aitune_manager):
    from aitune.plugins import AituneManager

    fake_distribution(
        "aitune-broken", "aitune_broken_plugin", "raise ImportError('libfoo.so: cannot open shared object')"
    )
    manager = AituneManager()
    with pytest.warns(
        RuntimeWarning,
        match=r"aitune plugin 'aitune_broken_plugin' from aitune-broken 9.9.9 failed to load "
        r"and is skipped: ImportError: libfoo.so: cannot open shared object",
    ):
        manager.load_entry_points()
    assert [p.name for p in manager.failed_plugins()] == ["aitune_broken_plugin"]


def test_worker_never_receives_a_pickle(fault_backends, tmp_path, monkeypatch):
    """The job the worker reads is JSON, and the exported folder holds only what export wrote."""
    seen = {}
    real = isolation.run_worker

    def spy(backend, notes, context, folder, *started):
        import json

        result = real(backend, notes, context, folder, *started)
        seen["job"] = json.loads((folder / "job.json").read_text())
        seen["files"] = sorted(p.name for p in (folder / "exported").iterdir())
        return result

    monkeypatch.setattr(isolation, "run_worker", spy)
    _tune(faults.IsolatedToyBackend())
    assert seen["files"] == ["module.txt"]
    assert seen["job"]["backend"] == "toy_isolated" and seen["job"]["config"]["speed"] == 0.0
    assert seen["job"]["memory_mb"] > 0 and os.path.isabs(seen["job"]["payload"])


def test_the_build_worker_never_runs_the_jit(fault_backends, monkeypatch):
    """A worker inherits the environment: with AITUNE_JIT=1 it would tune its own modules and log about it."""
    import subprocess

    seen = {}
    real = subprocess.Popen

    def spy(*args, **kwargs):
        seen["env"] = kwargs.get("env")
        return real(*args, **kwargs)

    monkeypatch.setenv("AITUNE_JIT", "1")
    monkeypatch.setattr(subprocess, "Popen", spy)
    _, report = _tune(faults.IsolatedToyBackend())
    assert _candidates(report)["toy_isolated"].status == "selected"
    assert seen["env"]["AITUNE_JIT"] == "0"
