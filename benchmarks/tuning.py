"""Backends and strategies as the harness builds them, shared by the parent and its children."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import aitune.torch as ait
from aitune.plugins import get_manager
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

from .models import Case, fastpath

STRATEGIES = ("max_throughput", "max_throughput_per_batch", "first_wins", "min_latency", "latency_budget")


def available_backends(device: str) -> tuple[list[str], dict[str, str]]:
    """Backend names usable on ``device`` (eager excluded), and why each other one is not."""
    registry = get_manager().registry
    usable, skipped = [], {}
    for name in registry.names():
        if name == "torch_eager":
            continue
        reason = registry.status(name).reason(device)
        if reason:
            skipped[name] = reason
        else:
            usable.append(name)
    return usable, skipped


def make_backend(name: str, threads: int) -> Any:
    """A backend with default settings, except ONNX Runtime, held to the harness's thread count."""
    registry = get_manager().registry
    cls = registry.backend_class(name)
    if name == "onnxruntime":
        from aitune.torch.backend import ONNXRuntimeBackendConfig

        return cls(ONNXRuntimeBackendConfig(intra_op_num_threads=threads, inter_op_num_threads=1))
    return cls()


def profiling_config(quick: bool, batch_sizes: list[int]) -> ProfilingConfig:
    steps = (
        NumStepsMeasuringStopStrategy(num_steps=20, warmup=3, window=5) if quick else NumStepsMeasuringStopStrategy()
    )
    return ProfilingConfig(batch_sizes=batch_sizes, measurement_stop_strategy=steps)


def make_strategy(
    name: str, backends: list[str], threads: int, quick: bool, batch_sizes: list[int], budget_ms: float | None
) -> Any:
    built = [make_backend(b, threads) for b in backends]
    config = profiling_config(quick, batch_sizes)
    if name == "max_throughput":
        return ait.MaxThroughputStrategy(backends=built, profiling_config=config)
    if name == "max_throughput_per_batch":
        return ait.MaxThroughputStrategy(backends=built, profiling_config=config, per_batch_size=True)
    if name == "first_wins":
        return ait.FirstWinsStrategy(backends=built, profiling_config=config)
    if name == "min_latency":
        return ait.MinLatencyStrategy(backends=built, profiling_config=profiling_config(quick, [1]))
    if name == "latency_budget":
        assert budget_ms is not None
        return ait.LatencyBudgetStrategy(budget_ms, backends=built, profiling_config=config)
    raise SystemExit(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")


def oracle_strategy(backend: str, threads: int) -> Any:
    """One backend, always kept: what it does alone, with no eager gate."""
    return ait.OneBackendStrategy(make_backend(backend, threads), performance_validation=False)


def wrap(case: Case, model: Any, strategy: Any) -> Any:
    """``model`` with the case's targets wrapped in ``ait.Module`` (the model itself when no targets)."""
    if case.targets is None:
        return ait.Module(model, case.name, strategy=strategy)
    return ait.wrap(model, list(case.targets), strategy=strategy)


def dataset(case: Case, batch_sizes: list[int], device: str) -> list[Any]:
    """Batch 1 and every measured size, so the tuned range covers them all and MinLatency has batch 1."""
    return [case.inputs(b, device, seed=100) for b in sorted({1, *batch_sizes})]


@dataclass
class Tuned:
    model: Any = None
    report: Any = None
    wall_s: float = 0.0
    error: str | None = None
    decisions: list[str] = field(default_factory=list)


def tune(case: Case, strategy: Any, batch_sizes: list[int], device: str, model: Any = None) -> Tuned:
    """Wrap a fresh copy of the case's model and tune it; an exception is kept, not raised."""
    model = copy.deepcopy(model) if model is not None else case.build(device)
    wrapped = wrap(case, model, strategy)
    start = time.perf_counter()
    try:
        with fastpath(case.fastpath):
            report = ait.tune(wrapped, dataset(case, batch_sizes, device), batch_sizes=sorted({1, *batch_sizes}))
    except Exception as exc:
        return Tuned(wall_s=time.perf_counter() - start, error=f"{type(exc).__name__}: {_first_line(exc)}")
    result = Tuned(wrapped, report, time.perf_counter() - start)
    for m in report.modules:
        if m.status == "failed":
            result.error = f"{m.name}: {m.error}"
        result.decisions += [g.decision or "torch_eager" for g in m.graphs]
    return result


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""
