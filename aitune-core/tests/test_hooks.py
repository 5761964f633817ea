"""Every hook is documented and tested here (a new hook without both fails this file)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import attrs
import pytest
import torch
from aitune_testkit.doubles import SlowModule, WrongBackend
from aitune_testkit.faults import IsolatedToyBackend

import aitune.torch as ait
from aitune import hookimpl, hookspecs
from aitune.backend import Backend, BuildContext, LoadContext
from aitune.builtin.eager import TorchEagerBackend
from aitune.graph import infer_graph
from aitune.report import ProfileResult, ValidationReport
from aitune.testing import TinyMLP, assert_matches_eager, tiny_samples
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5), extend_s=0.0
)
HOOKS = sorted(name for name, fn in vars(hookspecs).items() if name.startswith("aitune_") and callable(fn))


def test_there_are_hooks():
    assert len(HOOKS) == 12


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented(hook):
    assert re.search(rf"^### {hook}$", DOCS.read_text(), re.M), f"docs/plugins.md has no section for {hook}"
    assert inspect.getdoc(getattr(hookspecs, hook)), f"{hook} has no docstring"


BACKEND_MEMBERS = sorted(
    {name for name in vars(Backend) if not name.startswith("_")} | {"__init__", "config", "build_info"}
)


def test_the_backend_has_members():
    assert {"build", "infer", "save", "load", "export", "build_exported", "tolerance"} <= set(BACKEND_MEMBERS)


@pytest.mark.parametrize("member", BACKEND_MEMBERS)
def test_every_backend_member_is_documented(member):
    """A plugin author can write a backend from docs/plugins.md alone."""
    assert re.search(rf"^### Backend\.{re.escape(member)}$", DOCS.read_text(), re.M), (
        f"docs/plugins.md has no section '### Backend.{member}'"
    )


@pytest.mark.parametrize(
    ("context", "field"), [(c, f.name) for c in (BuildContext, LoadContext) for f in attrs.fields(c)]
)
def test_every_context_field_is_documented(context, field):
    docs = DOCS.read_text()
    table = docs[docs.index(f"`aitune.plugin.{context.__name__}`") :]
    assert f"| `{field}` |" in table.split("\n\n", 2)[1], (
        f"docs/plugins.md does not describe {context.__name__}.{field}"
    )


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_test(hook):
    assert f"test_hook_{hook}" in globals(), f"add test_hook_{hook} to {__file__}"


@pytest.mark.parametrize("hook", HOOKS)
def test_firstresult_hooks_say_so(hook):
    spec_opts = getattr(hookspecs, hook).aitune_spec
    doc = " ".join(inspect.getdoc(getattr(hookspecs, hook)).split())
    if spec_opts.get("firstresult"):
        assert "Stops at the first non-None result" in doc


@pytest.fixture
def fault_backends(toy_backends, register_plugin):
    from aitune_testkit import faults

    return register_plugin(faults, name="aitune_testkit.faults", distribution="aitune-testkit")


def _fast_model():
    return ait.Module(
        SlowModule(), "m", strategy=ait.OneBackendStrategy(ToyBackend(ToyConfig()), profiling_config=QUICK)
    )


def _setup(tmp_path):
    module, samples = TinyMLP().eval(), tiny_samples()
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    return module, samples, graph, BuildContext(graph, samples, torch.device("cpu"), tmp_path, tmp_path)


class LateBackend(TorchEagerBackend):
    name = "late"


def test_hook_aitune_register_backends(aitune_manager, register_plugin):
    from aitune.registry import BackendSpec

    class Late:
        @hookimpl
        def aitune_register_backends(self, registry):
            registry.add(BackendSpec(backend_class=f"{__name__}:LateBackend"))

    register_plugin(Late(), distribution="late-dist")  # registered after discovery: its own hook is still called
    assert aitune_manager.registry.distribution("late") == "late-dist"


def test_hook_aitune_register_executors(aitune_manager, fault_backends, register_plugin):
    from aitune.executor import ExecutorSpec

    class Late:
        @hookimpl
        def aitune_register_executors(self, registry):
            registry.add(ExecutorSpec(name="late", executor_class="aitune_testkit.executors:ThreadedExecutor"))

    register_plugin(Late(), distribution="late-dist")  # registered after discovery: its own hook is still called
    assert aitune_manager.executors.distribution("late") == "late-dist"
    model = ait.Module(SlowModule(), "m", strategy=ait.OneBackendStrategy(IsolatedToyBackend(), profiling_config=QUICK))
    report = ait.tune(model, [torch.randn(2, 8)], executor="late")
    candidate = report.modules[0].graphs[0].candidates[0]
    assert candidate.status == "selected", candidate.reason
    assert candidate.build_info["executor"] == "threads", "the executor the user named ran the build"


def test_hook_aitune_build(toy_backends, register_plugin, tmp_path):
    seen = []

    class Wrapper:
        @hookimpl(wrapper=True)
        def aitune_build(self, backend, module, context):
            seen.append(("before", backend.name))
            result = yield
            seen.append(("after", result.name))
            return result

    class PreEmpt:
        @hookimpl
        def aitune_build(self, backend, module, context):
            if backend.config.speed == 0.5:
                backend.module = module
                backend.build_info["from_cache"] = True
                return backend
            return None

    register_plugin(Wrapper())
    register_plugin(PreEmpt())
    model = ait.Module(
        SlowModule(),
        "m",
        strategy=ait.OneBackendStrategy(
            ToyBackend(ToyConfig(speed=0.5)), profiling_config=QUICK
        ).enable_performance_validation(False),
    )
    report = ait.tune(model, [torch.randn(2, 8)])
    assert seen == [("before", "toy"), ("after", "toy")]
    candidate = report.modules[0].graphs[0].candidates[0]
    assert candidate.from_cache and "built_for" not in candidate.build_info, "the default build did not run"


def test_operation_hooks_are_handed_the_run_session(toy_backends, register_plugin, aitune_manager):
    """A plugin that names ``session`` gets the run's relay, registry and builds, pytest-style."""
    seen = {}

    class Watcher:
        @hookimpl
        def aitune_build(self, backend, module, context, session):
            seen["build"] = session

        @hookimpl
        def aitune_validate(self, backend, reference, samples, graph, tolerances, session):
            seen["validate"] = session

    register_plugin(Watcher())
    model = ait.Module(SlowModule(), "m", strategy=ait.OneBackendStrategy(ToyBackend(), profiling_config=QUICK))
    ait.tune(model, [torch.randn(2, 8)])
    assert seen["build"] is seen["validate"], "one session for the whole run"
    session = seen["build"]
    assert session.registry is aitune_manager.registry and session.executors is aitune_manager.executors
    assert session.builds is not None and session.builds.executor.name == "local"
    assert session.hook is aitune_manager.hook


def test_hook_aitune_validate(toy_backends, register_plugin):
    class Veto:
        @hookimpl
        def aitune_validate(self, backend, reference, samples, graph, tolerances):
            return ValidationReport(passed=False, reason="vetoed by policy plugin")

    register_plugin(Veto())
    model = ait.Module(
        SlowModule(), "m", strategy=ait.FirstWinsStrategy(backends=[ToyBackend()], profiling_config=QUICK)
    )
    report = ait.tune(model, [torch.randn(2, 8)])
    assert report.modules[0].graphs[0].candidates[0].reason == "vetoed by policy plugin"
    assert model.state == "passthrough"


def test_hook_aitune_profile(toy_backends, register_plugin):
    calls = []

    class FakeClock:
        @hookimpl
        def aitune_profile(self, runners, batch_size, config, device):
            calls.append(list(runners))
            # eager measured as 10 ms, every other runner as 1 ms: the plugin's figures decide
            return {
                name: ProfileResult(batch_size, 1, ms, ms, ms, ms, 0.0, ms, batch_size / ms * 1000, [ms, ms])
                for name, ms in ((n, 10.0 if n.startswith("torch_eager") else 1.0) for n in runners)
            }

    register_plugin(FakeClock())
    model = ait.Module(
        SlowModule(), "m", strategy=ait.MaxThroughputStrategy(backends=[ToyBackend(ToyConfig(speed=1.0))])
    )
    report = ait.tune(model, [torch.randn(2, 8)])
    assert calls == [["torch_eager#probe"], ["torch_eager#0", "toy#1"]], "the noise probe, then the session"
    candidate = report.modules[0].graphs[0].candidates[0]
    dispatch = candidate.profiles[0].dispatch_ms
    assert candidate.speedup == pytest.approx(10.0 / (1.0 + dispatch)), "the plugin's figures, plus the dispatch cost"


def test_hook_aitune_serialize(aitune_manager, register_plugin, tmp_path):
    module, _samples, _graph, context = _setup(tmp_path)
    backend = ToyBackend()
    backend.build(module, context)
    assert aitune_manager.hook.aitune_serialize(
        backend=backend, directory=tmp_path, session=aitune_manager.session()
    ) == {"speed": 0.0}

    class Extra:
        @hookimpl(wrapper=True)
        def aitune_serialize(self, backend, directory):
            meta = yield
            return {**meta, "signed": True}

    register_plugin(Extra())
    assert (
        aitune_manager.hook.aitune_serialize(backend=backend, directory=tmp_path, session=aitune_manager.session())[
            "signed"
        ]
        is True
    )


def test_hook_aitune_deserialize(aitune_manager, tmp_path):
    module, samples, graph, context = _setup(tmp_path)
    backend = ToyBackend()
    backend.build(module, context)
    meta = aitune_manager.hook.aitune_serialize(backend=backend, directory=tmp_path, session=aitune_manager.session())
    fresh = ToyBackend()
    loaded = aitune_manager.hook.aitune_deserialize(
        backend=fresh,
        module=module,
        directory=tmp_path,
        context=LoadContext(graph, torch.device("cpu"), meta, tmp_path),
        session=aitune_manager.session(),
    )
    x = samples[0].args[0]
    assert_matches_eager(loaded.infer(x), module(x))


def test_hook_aitune_tune_started(toy_backends, register_plugin, tmp_path):
    started = []

    class Listener:
        @hookimpl
        def aitune_tune_started(self, report, report_path):
            started.append((report_path, list(report.modules)))

    register_plugin(Listener())
    returned = ait.tune(_fast_model(), [torch.randn(2, 8)], report_path=tmp_path / "report.json")
    assert started == [(tmp_path / "report.json", [])], "called once, before any module is tuned"
    assert returned.modules


def test_hook_aitune_build_error(toy_backends, register_plugin):
    errors = []

    class Listener:
        @hookimpl
        def aitune_build_error(self, module_name, graph, backend, error):
            errors.append((module_name, backend.name, str(error)))

    register_plugin(Listener())
    model = ait.Module(
        SlowModule(),
        "m",
        strategy=ait.FirstWinsStrategy(backends=[ToyBackend(ToyConfig(fail_build=True))], profiling_config=QUICK),
    )
    ait.tune(model, [torch.randn(2, 8)])
    assert errors == [("m", "toy", "toy compiler crashed on purpose")]


def test_hook_aitune_candidate_result(toy_backends, register_plugin):
    """Each candidate's result is told as soon as it is complete, not when the graph is decided."""
    events = []

    class Listener:
        @hookimpl
        def aitune_build(self, backend, module, context):
            events.append(("build", backend.name))

        @hookimpl
        def aitune_candidate_result(self, module_name, graph, candidate):
            events.append(("result", module_name, candidate.backend, candidate.status, candidate.stage))

        @hookimpl
        def aitune_tune_finished(self, report):
            events.append(("finished", report.modules[0].graphs[0].decision))

    register_plugin(Listener())
    backends = [ToyBackend(ToyConfig(fail_build=True)), ToyBackend(ToyConfig()), WrongBackend(ToyConfig())]
    strategy = ait.MaxThroughputStrategy(backends=backends, profiling_config=QUICK)
    ait.tune(ait.Module(SlowModule(), "m", strategy=strategy), [torch.randn(2, 8)])
    assert events == [
        ("build", "toy"),
        ("result", "m", "toy", "failed", "build"),  # before the next build starts
        ("build", "toy"),
        ("build", "toy_wrong"),
        ("result", "m", "toy_wrong", "failed", "validate"),
        ("result", "m", "toy", "pending", None),  # the correct one: once profiled, before the decision
        ("finished", "toy"),
    ]


def test_hook_aitune_candidate_result_fires_once_per_candidate(toy_backends, register_plugin):
    """A candidate that passes the gate is told once, with its figures; the decision follows in the report."""
    results = []

    class Listener:
        @hookimpl
        def aitune_candidate_result(self, module_name, graph, candidate):
            results.append((module_name, candidate.backend, len(candidate.profiles) > 0))

    register_plugin(Listener())
    ait.tune(_fast_model(), [torch.randn(2, 8)])
    assert results == [("m", "toy", True)]


def test_hook_aitune_tune_failed(toy_backends, register_plugin):
    calls = []

    class Listener:
        @hookimpl
        def aitune_tune_failed(self, report, error):
            calls.append((list(report.modules), type(error).__name__))

        @hookimpl
        def aitune_tune_finished(self, report):
            calls.append("finished")

    register_plugin(Listener())
    broken = ait.Module(SlowModule(), "m", strategy=ait.OneBackendStrategy(ToyBackend(ToyConfig(fail_build=True))))
    with pytest.raises(Exception, match="toy compiler crashed on purpose"):
        ait.tune(broken, [torch.randn(2, 8)])
    assert calls == [([], "RuntimeError")], "called once, with what finished before the error; not finished"


def test_hook_aitune_tune_finished(toy_backends, register_plugin):
    reports = []

    class Listener:
        @hookimpl
        def aitune_tune_finished(self, report):
            reports.append(report)

    register_plugin(Listener())
    returned = ait.tune(_fast_model(), [torch.randn(2, 8)])
    assert reports == [returned]
