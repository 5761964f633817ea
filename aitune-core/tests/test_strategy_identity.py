"""A strategy's identity is its frozen config serialized: every parameter is in it, and it keys the
JIT's remembered decisions, the ranks' agreement and the report (issue 54 item 1).

A changed ``min_speedup_ratio``, ``static_shapes``, ``latency_budget_ms``, profiling config,
performance validation mode or backend config once reused a decision remembered under the old
value, because the key named only the backends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import aitune.torch as ait
from aitune.engine import ranks
from aitune.engine.recording import bypass
from aitune.engine.strategies import PerformanceValidationMode, StrategyConfig, TuneStrategy
from aitune.testing import assert_matches_eager
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch import jit
from aitune.torch.jit import config as jit_config
from aitune.torch.task.profiling import (
    CvMeasuringStopStrategy,
    NumStepsMeasuringStopStrategy,
    ProfilingConfig,
)
from aitune.torch.task.profiling.profiling_stop_strategy import ThroughputSaturatedProfilingStopStrategy

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=4, warmup=1, window=2), extend_s=0.0
)

Make = Callable[..., TuneStrategy]


def one_backend(**kw: Any) -> TuneStrategy:
    backend = kw.pop("backend", ToyBackend())
    return ait.OneBackendStrategy(backend, **{"profiling_config": QUICK, **kw})


def first_wins(**kw: Any) -> TuneStrategy:
    return ait.FirstWinsStrategy(**{"backends": [ToyBackend()], "profiling_config": QUICK, **kw})


def max_throughput(**kw: Any) -> TuneStrategy:
    return ait.MaxThroughputStrategy(**{"backends": [ToyBackend()], "profiling_config": QUICK, **kw})


def min_latency(**kw: Any) -> TuneStrategy:
    return ait.MinLatencyStrategy(**{"backends": [ToyBackend()], "profiling_config": QUICK, **kw})


def latency_budget(**kw: Any) -> TuneStrategy:
    return ait.LatencyBudgetStrategy(
        **{"latency_budget_ms": 1e6, "backends": [ToyBackend()], "profiling_config": QUICK, **kw}
    )


COMMON: list[tuple[str, dict[str, Any]]] = [
    ("performance_validation=False", {"performance_validation": False}),
    ("diagnostic", {"performance_validation": PerformanceValidationMode.DIAGNOSTIC}),
    ("profiling num_steps", {"profiling_config": ProfilingConfig()}),
    ("profiling max_noise", {"profiling_config": ProfilingConfig(max_noise=0.2)}),
    ("profiling batch_sizes", {"profiling_config": ProfilingConfig(batch_sizes=[1, 2])}),
    ("profiling stop", {"profiling_config": ProfilingConfig(measurement_stop_strategy=CvMeasuringStopStrategy())}),
    (
        "profiling saturation",
        {"profiling_config": ProfilingConfig(profiling_stop_strategy=ThroughputSaturatedProfilingStopStrategy())},
    ),
]
LISTED: list[tuple[str, dict[str, Any]]] = [
    ("backend config", {"backends": [ToyBackend(ToyConfig(speed=0.5))]}),
    ("two backends", {"backends": [ToyBackend(), ToyBackend(ToyConfig(speed=0.5))]}),
    ("backend order", {"backends": [ToyBackend(ToyConfig(speed=0.5)), ToyBackend()]}),
    ("default backends", {"backends": None}),
]
CHANGES: list[tuple[Make, str, dict[str, Any]]] = [
    *[(one_backend, name, kw) for name, kw in COMMON],
    (one_backend, "backend config", {"backend": ToyBackend(ToyConfig(speed=0.5))}),
    (one_backend, "min_speedup_ratio", {"min_speedup_ratio": 0.2}),
    *[(make, name, kw) for make in (first_wins, max_throughput, min_latency, latency_budget) for name, kw in COMMON],
    *[(make, name, kw) for make in (first_wins, max_throughput, min_latency, latency_budget) for name, kw in LISTED],
    (first_wins, "min_speedup_ratio", {"min_speedup_ratio": 0.2}),
    (max_throughput, "static_shapes", {"static_shapes": True}),
    (max_throughput, "min_static_gain", {"min_static_gain": 0.1}),
    (max_throughput, "per_batch_size=True", {"per_batch_size": True}),
    (max_throughput, "per_batch_size=False", {"per_batch_size": False}),
    (latency_budget, "latency_budget_ms", {"latency_budget_ms": 5.0}),
]


@pytest.mark.parametrize(("make", "name", "change"), CHANGES, ids=[f"{m.__name__}-{n}" for m, n, _ in CHANGES])
def test_changing_any_parameter_changes_the_identity(make: Make, name: str, change: dict[str, Any]) -> None:
    before, after = make(), make(**change)
    assert make().identity() == before.identity(), "the same parameters give the same identity"
    assert after.identity() != before.identity(), name
    if name != "backend config":  # the repr names backends, not their configs
        assert repr(after) != repr(before), f"the repr, derived from the config, shows {name} too"


def test_each_strategy_has_its_own_identity() -> None:
    made = [make() for make in (one_backend, first_wins, max_throughput, min_latency, latency_budget)]
    assert len({s.identity() for s in made}) == len(made)


def test_setters_replace_the_frozen_config_and_change_the_identity() -> None:
    strategy = max_throughput()
    config, identity = strategy.config, strategy.identity()
    with pytest.raises(AttributeError):
        config.static_shapes = True  # type: ignore[misc]
    strategy.static_shapes = True
    assert strategy.config is not config and strategy.config.static_shapes
    assert strategy.identity() != identity
    identity = strategy.identity()
    strategy.enable_performance_validation(False)
    assert strategy.identity() != identity and strategy.config.performance_validation.value != "enabled"
    gate = first_wins()
    identity = gate.identity()
    gate.min_speedup_ratio = 0.5
    assert gate.identity() != identity
    with pytest.raises(ValueError, match="min_speedup_ratio must be >= 0"):
        gate.min_speedup_ratio = -1
    with pytest.raises(ValueError, match="latency_budget_ms must be > 0"):
        latency_budget(latency_budget_ms=0)


def test_equal_values_of_another_type_are_one_identity() -> None:
    assert first_wins(min_speedup_ratio=0).identity() == first_wins(min_speedup_ratio=0.0).identity()
    assert latency_budget(latency_budget_ms=5).identity() == latency_budget(latency_budget_ms=5.0).identity()


def test_a_subclass_attribute_outside_the_config_is_in_the_identity_too() -> None:
    class Picky(ait.FirstWinsStrategy):
        def __init__(self, threshold: int) -> None:
            super().__init__([ToyBackend()])
            self.threshold = threshold

    assert Picky(1).identity() != Picky(2).identity()
    assert json.loads(Picky(1).identity())["attributes"] == {"threshold": 1}


def test_the_identity_is_canonical_json_of_the_class_and_config() -> None:
    strategy = max_throughput(static_shapes=True)
    data = json.loads(strategy.identity())
    assert data == strategy.identity_data()
    assert data["strategy"] == "aitune.engine.strategies.MaxThroughputStrategy"
    assert data["config"]["static_shapes"] is True
    assert data["config"]["backends"] == [
        {
            "backend": "toy",
            "class": "aitune.testing.backends.ToyBackend",
            "config": {
                "type": "aitune.testing.backends.ToyConfig",
                "speed": 0.0,
                "max_batch": None,
                "fail_build": False,
            },
        }
    ]
    assert isinstance(strategy.config, StrategyConfig)
    assert strategy.identity() == json.dumps(data, sort_keys=True, separators=(",", ":"))


IN_A_NEW_PROCESS = """
import json
from tests_identity_cases import cases
print(json.dumps([s.identity() for s in cases()]))
"""


def cases() -> list[TuneStrategy]:
    return [
        one_backend(min_speedup_ratio=0.3),
        first_wins(backends=[ToyBackend(ToyConfig(speed=0.5)), ToyBackend()], performance_validation=False),
        max_throughput(static_shapes=True, per_batch_size=True, profiling_config=ProfilingConfig(batch_sizes=[1, 4])),
        min_latency(performance_validation=PerformanceValidationMode.DIAGNOSTIC),
        latency_budget(latency_budget_ms=12.5, profiling_config=ProfilingConfig(max_noise=0.2)),
        ait.FirstWinsStrategy(),
    ]


@pytest.mark.parametrize("seed", ["0", "1234"])
def test_the_same_parameters_give_the_same_identity_in_a_new_process(seed: str, tmp_path: Path) -> None:
    """No object ids, no hash or insertion order: another interpreter (another hash seed) agrees."""
    (tmp_path / "tests_identity_cases.py").write_text(Path(__file__).read_text())
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", IN_A_NEW_PROCESS], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [s.identity() for s in cases()]


def test_the_report_names_the_strategy_by_its_identity(toy_backends: Any) -> None:
    from aitune_testkit.doubles import SlowModule

    strategy = first_wins(performance_validation=False, min_speedup_ratio=0.3)
    model = ait.Module(SlowModule().eval(), "m", strategy=strategy)
    report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
    assert report.modules[0].strategy == strategy.identity()


def test_ranks_that_differ_in_one_parameter_do_not_agree_and_name_it() -> None:
    def plan(strategy: TuneStrategy) -> dict[str, Any]:
        graph = SimpleNamespace(without_values=lambda: {"dims": {}})
        graph_plan = SimpleNamespace(not_tuned=None, graph=graph, candidates=list, strategy=strategy)
        module_plan = SimpleNamespace(module=SimpleNamespace(name="m"), graphs=[graph_plan])
        run = SimpleNamespace(registry=None, device=torch.device("cpu"))
        return ranks.plan([module_plan], run)  # type: ignore[list-item, arg-type]

    same = ranks._first_difference(plan(first_wins()), plan(first_wins()), "plan", 1)
    assert same is None
    where = ranks._first_difference(plan(first_wins()), plan(first_wins(min_speedup_ratio=0.2)), "plan", 1)
    assert (
        where == "plan.modules[0].graphs[0].strategy.config.min_speedup_ratio is '0.01' on rank 0 and '0.2' on rank 1"
    )
    json.dumps(plan(max_throughput()))  # the plan travels between ranks as JSON


# -- the JIT's remembered decisions ----------------------------------------------------------------


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


@pytest.fixture
def jit_runs(toy_backends: Any) -> Iterator[Callable[[TuneStrategy, torch.nn.Module], tuple[str, bool]]]:
    """One JIT "run" per call (everything forgotten but the cache dir): the module's outcome and
    whether it came from a remembered decision."""
    jit_config.reset()

    def run(strategy: TuneStrategy, model: torch.nn.Module) -> tuple[str, bool]:
        with jit_config.patch(strategy=strategy, min_parameters=0, min_samples=2, mode="inline"):
            jit.enable()
            try:
                with torch.no_grad():
                    for batch in (2, 3, 2):
                        x = torch.randn(batch, 8)
                        y = model(x)
                        with bypass():
                            assert_matches_eager(y, model(x))
                [decision] = jit.decisions()
                return decision.outcome, decision.from_cache
            finally:
                jit.disable()

    yield run
    jit_config.reset()


JIT_CHANGES: list[tuple[Make, str, dict[str, Any]]] = [
    (first_wins, "min_speedup_ratio", {"min_speedup_ratio": 0.2}),
    (first_wins, "profiling", {"profiling_config": ProfilingConfig(max_noise=0.2)}),
    (first_wins, "performance validation", {"performance_validation": PerformanceValidationMode.DIAGNOSTIC}),
    (first_wins, "backend config", {"backends": [ToyBackend(ToyConfig(speed=0.5))]}),
    (one_backend, "min_speedup_ratio", {"min_speedup_ratio": 0.2}),
    (max_throughput, "static_shapes", {"static_shapes": True}),
    (max_throughput, "min_static_gain", {"min_static_gain": 0.1}),
    (max_throughput, "per_batch_size", {"per_batch_size": False}),
    (min_latency, "profiling", {"profiling_config": ProfilingConfig(batch_sizes=[1])}),
    (latency_budget, "latency_budget_ms", {"latency_budget_ms": 5e5}),
]


@pytest.mark.parametrize(("make", "name", "change"), JIT_CHANGES, ids=[f"{m.__name__}-{n}" for m, n, _ in JIT_CHANGES])
def test_a_changed_parameter_gets_a_new_jit_decision(
    jit_runs: Callable[[TuneStrategy, torch.nn.Module], tuple[str, bool]], make: Make, name: str, change: dict[str, Any]
) -> None:
    torch.manual_seed(0)
    model = Block().eval()
    # the eager gate off: the toy backend's decision never depends on a timing race
    base: dict[str, Any] = {"performance_validation": False}
    assert jit_runs(make(**base), model) == ("tuned", False)
    assert jit_runs(make(**base), model) == ("tuned", True), "the same parameters: the decision is reused"
    changed = {**base, **change}
    _, from_cache = jit_runs(make(**changed), model)
    assert not from_cache, f"a decision made under the old {name} was reused"
    assert jit_runs(make(**changed), model)[1], "and the new one is remembered under its own key"


def test_a_decision_remembered_under_the_old_key_format_is_not_matched(
    jit_runs: Callable[[TuneStrategy, torch.nn.Module], tuple[str, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the key held the strategy's repr; such an entry is simply never found again."""
    torch.manual_seed(0)
    model = Block().eval()
    with monkeypatch.context() as patch:
        patch.setattr(TuneStrategy, "identity", lambda self: "FirstWinsStrategy(backends=['toy'])")
        assert jit_runs(first_wins(performance_validation=False), model) == ("tuned", False)
        assert jit_runs(first_wins(performance_validation=False), model) == ("tuned", True)
    assert jit_runs(first_wins(performance_validation=False), model) == ("tuned", False)
