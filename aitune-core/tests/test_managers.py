"""Several plugin managers in one process: each run uses the manager it is given, and a plugin's
registration is bound to its distribution and taken back whole when it fails."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import aitune.torch as ait
from aitune import hookimpl
from aitune.artifact import verify
from aitune.cli import app
from aitune.errors import ArtifactError, DuplicateBackendError, PluginError
from aitune.executor import ExecutorSpec
from aitune.plugins import AituneManager, get_manager
from aitune.registry import BackendSpec
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=5, warmup=1, window=5), extend_s=0.0
)


class AlphaBackend(ToyBackend):
    name = "alpha"


class BetaBackend(ToyBackend):
    name = "beta"


class OwnPlugin:
    """Declares one backend and notes every tune it hears of."""

    def __init__(self, backend: type[ToyBackend]) -> None:
        self.backend = backend
        self.finished: list[Any] = []

    @hookimpl
    def aitune_register_backends(self, registry: Any) -> None:
        registry.add(BackendSpec(backend_class=f"{__name__}:{self.backend.__name__}", default_candidate=False))

    @hookimpl
    def aitune_tune_finished(self, report: Any) -> None:
        self.finished.append(report)


def manager_with(backend: type[ToyBackend]) -> tuple[AituneManager, OwnPlugin]:
    manager, plugin = AituneManager(), OwnPlugin(backend)
    manager.register(plugin, name=f"own-{backend.name}", distribution=f"{backend.name}-dist")
    return manager, plugin


def tune_and_save(backend: type[ToyBackend], manager: AituneManager, path: Any) -> ait.Module:
    strategy = ait.OneBackendStrategy(backend(ToyConfig()), profiling_config=QUICK).enable_performance_validation(False)
    model = ait.Module(torch.nn.Linear(8, 8).eval(), "m", strategy=strategy)
    report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], end_to_end=False, manager=manager)
    assert report.modules[0].graphs[0].decision == backend.name, report.modules[0].summary
    ait.save(model, path, manager=manager)
    return model


def fresh() -> ait.Module:
    return ait.Module(torch.nn.Linear(8, 8).eval(), "m")


def test_two_managers_with_different_plugins_tune_save_and_load_independently(tmp_path, aitune_cache_dir):
    alpha, alpha_plugin = manager_with(AlphaBackend)
    beta, beta_plugin = manager_with(BetaBackend)
    assert "alpha" in alpha.registry and "alpha" not in beta.registry and "alpha" not in get_manager().registry
    assert alpha.converter is not beta.converter, "each manager owns its converter"

    tune_and_save(AlphaBackend, alpha, tmp_path / "alpha.ait")
    tune_and_save(BetaBackend, beta, tmp_path / "beta.ait")
    assert len(alpha_plugin.finished) == 1 and len(beta_plugin.finished) == 1, "each tune calls its own manager's hooks"

    loaded = ait.load(fresh(), tmp_path / "alpha.ait", weights="artifact", manager=alpha)
    assert [backend.name for _, backend in loaded.tuned_graphs] == ["alpha"]
    assert ait.load(fresh(), tmp_path / "beta.ait", weights="artifact", manager=beta).tuned_graphs[0][1].name == "beta"
    with pytest.raises(ArtifactError, match="alpha"):
        ait.load(fresh(), tmp_path / "alpha.ait", weights="artifact", manager=beta)
    with pytest.raises(ArtifactError, match="beta"):
        ait.load(fresh(), tmp_path / "beta.ait", weights="artifact")  # the process's manager has neither plugin
    assert verify(tmp_path / "alpha.ait", manager=alpha)["runnable_here"]
    assert not verify(tmp_path / "alpha.ait", manager=beta)["runnable_here"]


def test_a_manager_reads_and_writes_the_configs_of_its_own_backends_only():
    alpha, _ = manager_with(AlphaBackend)
    beta, _ = manager_with(BetaBackend)
    data = alpha.registry.config_to_json(ToyConfig(speed=0.5))
    assert data == {"backend": "alpha", "speed": 0.5, "max_batch": None, "fail_build": False}
    assert alpha.registry.config_from_json(data) == ToyConfig(speed=0.5)
    with pytest.raises(Exception, match="unknown backend 'alpha'"):
        beta.registry.config_from_json(data)


def test_the_cli_commands_use_the_manager_given_as_their_context_object():
    alpha, _ = manager_with(AlphaBackend)
    result = CliRunner().invoke(app, ["backends", "--json"], obj=alpha)
    assert result.exit_code == 0, result.output
    rows = {row["backend"]: row for row in json.loads(result.output)}
    assert rows["alpha"]["distribution"] == "alpha-dist"
    plain = CliRunner().invoke(app, ["backends", "--json"])
    assert "alpha" not in {row["backend"] for row in json.loads(plain.output)}


class HalfRegistering:
    """Adds a good backend and an executor, then fails in the hook named by ``fail_in``."""

    def __init__(self, fail_in: str) -> None:
        self.fail_in = fail_in

    @hookimpl
    def aitune_register_backends(self, registry: Any) -> None:
        registry.add(BackendSpec(backend_class=f"{__name__}:AlphaBackend"))
        if self.fail_in == "backends":
            registry.add(BackendSpec(backend_class="aitune.builtin.eager:TorchEagerBackend"))  # core's: a duplicate

    @hookimpl
    def aitune_register_executors(self, registry: Any) -> None:
        registry.add(ExecutorSpec(name="half", executor_class="aitune_testkit.executors:ThreadedExecutor"))
        if self.fail_in == "executors":
            raise RuntimeError("the executor plugin broke half-way")


@pytest.mark.parametrize(
    ("fail_in", "error", "message"),
    [
        ("backends", DuplicateBackendError, "both aitune-core and half-dist"),
        ("executors", PluginError, "plugin 'half' from half-dist failed to register: the executor plugin broke"),
    ],
)
def test_a_failed_registration_takes_back_everything_the_plugin_declared(fail_in, error, message):
    manager = AituneManager()
    backends, executors = manager.registry.names(), manager.executors.names()
    with pytest.raises(error, match=message):
        manager.register(HalfRegistering(fail_in), name="half", distribution="half-dist")
    assert manager.registry.names() == backends and manager.executors.names() == executors
    assert "half" not in manager.plugins and not manager.pm.has_plugin("half")
    assert manager.registry.distribution("torch_eager") == "aitune-core", "the other plugin's backend stays"

    manager.register(OwnPlugin(AlphaBackend), name="alpha", distribution="alpha-dist")
    assert manager.registry.distribution("alpha") == "alpha-dist", "the name is free again after the rollback"


def test_each_plugin_registers_in_its_own_name_and_entry_point():
    manager = AituneManager()
    manager.register(OwnPlugin(AlphaBackend), name="alpha", distribution="alpha-dist", entry_point=True)
    manager.register(OwnPlugin(BetaBackend), name="beta", distribution="beta-dist")
    assert manager.registry.distribution("alpha") == "alpha-dist"
    assert manager.registry.distribution("beta") == "beta-dist"
    assert manager.registry.distribution("torch_eager") == "aitune-core"
    assert manager.executors.distribution("local") == "aitune-core"
    with pytest.raises(PluginError, match="entry point 'gamma' of gamma-dist registers the backend 'alpha'"):
        AituneManager().register(OwnPlugin(AlphaBackend), name="gamma", distribution="gamma-dist", entry_point=True)


class BuildCounter:
    def __init__(self) -> None:
        self.backends: list[str] = []

    @hookimpl(wrapper=True)
    def aitune_build(self, backend: Any) -> Any:
        self.backends.append(backend.name)
        return (yield)


def test_the_jit_tunes_with_the_manager_it_was_enabled_with(aitune_cache_dir):
    from aitune.torch import FirstWinsStrategy, jit
    from aitune.torch.jit import config as jit_config

    alpha, _ = manager_with(AlphaBackend)
    counter = BuildCounter()
    alpha.register(counter, name="build-counter", distribution="test")
    strategy = FirstWinsStrategy([AlphaBackend()], performance_validation=False)
    jit_config.reset()
    with jit_config.patch(strategy=strategy, min_parameters=0, min_samples=2, mode="inline"):
        jit.enable(manager=alpha)
        try:
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).eval()
            with torch.no_grad():
                for batch in (2, 3, 2):
                    model(torch.randn(batch, 8))
            assert [(d.outcome, d.backends) for d in jit.decisions()] == [("tuned", ("alpha",))]
            assert counter.backends == ["alpha"], "the builds went through the given manager's hooks"
        finally:
            jit.disable()
    jit_config.reset()
