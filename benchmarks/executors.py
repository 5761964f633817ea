"""Tune wall time of the ``pipeline`` case with the local executor and with Ray (1 and 2 workers).

``python -m benchmarks.executors [--out results.json]``. Each configuration runs in a fresh
process with an empty ``AITUNE_CACHE_DIR`` (no build-cache hits, a cold Inductor cache), one
torch thread, and the same candidates per module: AOTInductor (built in a worker, so on Ray when
the executor is Ray) and ONNX Runtime (built in-process). Ray's start-up is timed apart from the
tune. The decisions of every configuration are printed next to its time: they must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIGS = {"local": None, "ray, 1 worker": 1, "ray, 2 workers": 2}


def child(config: str) -> dict[str, Any]:
    import torch

    import aitune.torch as ait
    from aitune.torch.backend import ONNXRuntimeBackend, TorchInductorAotBackend
    from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

    from .models import get

    torch.set_num_threads(1)
    workers = CONFIGS[config]
    ray_init_s = None
    if workers is not None:
        import ray

        start = time.perf_counter()
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        ray_init_s = time.perf_counter() - start
    case = get("pipeline")
    model = case.build()
    quick = ProfilingConfig(measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=20, warmup=3, window=5))
    for name in ("encoder", "head"):
        strategy = ait.MaxThroughputStrategy([TorchInductorAotBackend(), ONNXRuntimeBackend()], quick)
        setattr(model, name, ait.Module(getattr(model, name), name, strategy=strategy))
    data = [case.inputs(1), case.inputs(8)]
    start = time.perf_counter()
    report = ait.tune(model, data, executor="local" if workers is None else "ray")
    tune_s = time.perf_counter() - start
    builds = {  # the build itself, where it ran (a build done ahead is only waited for here)
        f"{m.name}/{c.backend}": round(c.build_info.get("worker_s", c.build_time_s or 0.0), 1)
        for m in report.modules
        for c in m.graphs[0].candidates
    }
    throughput = {
        f"{m.name}/{c.backend}": round(p.throughput)
        for m in report.modules
        for c in m.graphs[0].candidates
        for p in c.profiles
        if p.batch_size == m.graphs[0].selected_batch_size
    }
    return {
        "config": config,
        "tune_s": round(tune_s, 1),
        "ray_init_s": round(ray_init_s, 1) if ray_init_s is not None else None,
        "decisions": {m.name: m.graphs[0].decision for m in report.modules},
        "build_s": builds,
        "samples_per_s": throughput,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.executors", description=__doc__)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    results = []
    for config in CONFIGS:
        with tempfile.TemporaryDirectory(prefix="aitune-bench-exec-") as cache:
            env = {**os.environ, "AITUNE_CACHE_DIR": cache, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            env.pop("TORCHINDUCTOR_CACHE_DIR", None)
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.executors", "--child", config],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    print(
        "\n| executor | tune wall time (s) | Ray start (s) | decisions | build time per candidate (s) | samples/s at the decided batch |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        decisions = ", ".join(f"{k}: {v}" for k, v in r["decisions"].items())
        builds = ", ".join(f"{k} {v}" for k, v in r["build_s"].items())
        ray_s = "" if r["ray_init_s"] is None else r["ray_init_s"]
        speed = ", ".join(f"{k} {v}" for k, v in r["samples_per_s"].items())
        print(f"| {r['config']} | {r['tune_s']} | {ray_s} | {decisions} | {builds} | {speed} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
