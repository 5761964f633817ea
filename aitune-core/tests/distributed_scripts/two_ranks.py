"""Run by torchrun with two gloo ranks (see test_distributed.py); writes each scenario's outcome
per rank as JSON into the folder given as the first argument."""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune import hookimpl
from aitune.plugins import get_manager
from aitune.testing import assert_matches_eager
from aitune.testing import backends as toys
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5), extend_s=0.0
)


class Pipeline(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        candidates = [ToyBackend(ToyConfig(speed=0.0)), ToyBackend(ToyConfig(speed=0.02))]
        self.encoder = ait.Module(SlowModule(), "encoder", strategy=ait.MaxThroughputStrategy(candidates, QUICK))
        routed = ait.MaxThroughputStrategy(candidates, QUICK, per_batch_size=True)  # decisions by batch range
        self.head = ait.Module(SlowModule(), "head", strategy=routed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def installed(model: Pipeline) -> list[list[str]]:
    return [
        [f"{b.name}:{getattr(b.config, 'speed', '')}" for _, b in m.tuned_graphs] for m in (model.encoder, model.head)
    ]


class SlowOnRankOne(ToyBackend):
    """Its speed on rank 0; 10 ms slower per call on rank 1 (another GPU, a busier node)."""

    def infer(self, *args, **kwargs):
        if dist.get_rank() == 1:
            time.sleep(0.01)
        return super().infer(*args, **kwargs)


class WrongOnRankOne(ToyBackend):
    """Correct on rank 0, wrong on rank 1: the ranks cannot time the same candidates."""

    def transform(self, output, args):
        return output + 1.0 if dist.get_rank() == 1 else output


def single(strategy: ait.MaxThroughputStrategy) -> ait.Module:
    return ait.Module(SlowModule(), "single", strategy=strategy)


class FasterStatic(ToyBackend):
    """Builds static: built for one batch size it drops the module's sleep and serves that size alone."""

    name = "toy_faster_static"
    builds_static = True

    def build(self, module, context):
        super().build(module, context)
        batch = context.graph.batch
        self.pinned = batch.min if batch is not None and batch.min == batch.max else None
        for sub in self.module.modules() if self.pinned is not None else ():
            if "delay_s" in vars(sub):
                sub.delay_s = sub.per_row_s = 0.0

    def infer(self, *args, **kwargs):
        if self.pinned is not None and args[0].shape[0] != self.pinned:
            raise RuntimeError(f"built for batch {self.pinned} alone, called with {args[0].shape[0]}")
        return super().infer(*args, **kwargs)


class StaticToys:
    @hookimpl
    def aitune_register_backends(self, registry):
        toys.register(registry, (FasterStatic,), __name__)


class InjectedFailure:
    @hookimpl(tryfirst=True)
    def aitune_build(self, backend, module, context):
        raise RuntimeError(f"injected build failure on rank {dist.get_rank()}")


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    manager = get_manager()
    manager.register(toys, name="aitune.testing.backends", distribution="aitune-core")
    torch.manual_seed(rank)  # each rank its own data, of the same shapes
    data = [torch.randn(2, 8), torch.randn(4, 8)]
    outcome: dict = {"rank": rank}

    # 1. the ranks agree; the artifact rank 0 saves loads on both
    model = Pipeline()
    report = ait.tune(model, data, report_path=out / "tune.json")
    outcome["decisions"] = [g.decision for m in report.modules for g in m.graphs]
    outcome["routes"] = [[r.backend for r in g.routes] for m in report.modules for g in m.graphs]
    outcome["installed"] = installed(model)
    outcome["distributed"] = report.environment.get("distributed")
    outcome["winner_validated_here"] = all(
        c.validation is not None and c.validation.passed
        for m in report.modules
        for g in m.graphs
        for c in g.candidates
        if c.status == "selected"
    )
    if rank == 0:
        ait.save(model, out / "model.ait")
    dist.barrier()
    loaded = ait.load(Pipeline(), out / "model.ait")
    x = torch.randn(3, 8)
    assert_matches_eager(loaded(x), model.head.module(model.encoder.module(x)))
    outcome["loaded"] = installed(loaded)

    # 2. ranks that recorded different shapes refuse to share a decision, on both ranks
    other = [torch.randn(2, 8), torch.randn(6 if rank else 4, 8)]
    try:
        ait.tune(Pipeline(), other)
        outcome["mismatch"] = None
    except Exception as exc:
        outcome["mismatch"] = f"{type(exc).__name__}: {exc}"

    # 3. a build failure injected on rank 1 fails the tune on both ranks, which then run eager
    if rank == 1:
        manager.register(InjectedFailure(), name="injected-failure")
    failing = Pipeline()
    try:
        ait.tune(failing, data)
        outcome["injected"] = None
    except Exception as exc:
        outcome["injected"] = f"{type(exc).__name__}: {exc}"
    outcome["states_after_failure"] = [failing.encoder.state, failing.head.state]

    # 4. every rank times its own builds and the slowest rank's figures decide, the same on every rank
    manager.pm.unregister(name="injected-failure") if rank == 1 else None
    fast_here = SlowOnRankOne(ToyConfig(speed=0.0))  # the fastest on rank 0, the slowest on rank 1
    model = single(ait.MaxThroughputStrategy([ToyBackend(ToyConfig(speed=0.5)), fast_here], QUICK))
    report = ait.tune(model, data, rank_decision="slowest")
    candidates = report.modules[0].graphs[0].candidates
    outcome["slowest"] = {
        "installed": [f"{b.name}:{b.config.speed}" for _, b in model.tuned_graphs],
        "decided_by": report.environment["distributed"]["decided_by"],
        "p50": {str(c.config["speed"]): [p.p50_ms for p in c.profiles] for c in candidates},
        "speedup": {str(c.config["speed"]): c.speedup for c in candidates},
    }

    # 5. a candidate that passes validation on one rank only: the tune fails on both ranks, which run eager
    model = single(ait.MaxThroughputStrategy([ToyBackend(ToyConfig(speed=0.5)), WrongOnRankOne(ToyConfig())], QUICK))
    try:
        ait.tune(model, data, rank_decision="slowest")
        outcome["diverged"] = None
    except Exception as exc:
        outcome["diverged"] = f"{type(exc).__name__}: {exc}"
    outcome["state_after_divergence"] = model.state

    # 6. the only candidate is wrong on rank 1, which then profiles nothing: still no hang
    model = single(ait.MaxThroughputStrategy([WrongOnRankOne(ToyConfig())], QUICK))
    try:
        ait.tune(model, data, rank_decision="slowest")
        outcome["nothing_to_time"] = None
    except Exception as exc:
        outcome["nothing_to_time"] = f"{type(exc).__name__}: {exc}"

    # 7. static-shape builds: rank 0 keeps one per batch size, and every rank builds each for its size alone
    manager.register(StaticToys(), name="static-toys")
    strategy = ait.MaxThroughputStrategy([FasterStatic(ToyConfig(speed=0.5))], QUICK, static_shapes=True)
    model = single(strategy)
    report = ait.tune(model, data)
    with torch.no_grad():
        for x in data:  # each size served by its own static build (any other size would raise)
            assert_matches_eager(model(x), model.module(x))
    outcome["static"] = {
        "routes": [[r.backend, r.static, r.batch_min, r.batch_max] for r in report.modules[0].graphs[0].routes],
        "pinned": [getattr(b, "pinned", None) for _, b in model.tuned_graphs],
        "validated_here": [
            c.validation is not None and c.validation.passed
            for c in report.modules[0].graphs[0].candidates
            if c.status == "selected"
        ],
    }

    (out / f"outcome-{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
