"""``python -m benchmarks``: set thread variables, then (and only then) import torch and run."""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_BATCH_SIZES = "1,8,32"
QUICK_BATCH_SIZES = "1,8"
CASE_NAMES = ("mlp", "cnn", "encoder", "encoder_nofast", "gru", "pipeline")  # kept equal to models.CASES


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer steps, batch sizes, repeats and cold starts (~5 min)")
    p.add_argument("--models", default=None, help="comma-separated case names (default: all); see --list")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument(
        "--batch-sizes",
        default=None,
        help=f"measured batch sizes (default {DEFAULT_BATCH_SIZES}, "
        f"quick {QUICK_BATCH_SIZES}); tuning always records batch 1 too",
    )
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP / ONNX Runtime threads (default 1)")
    p.add_argument(
        "--wait-policy",
        default="ACTIVE",
        choices=["ACTIVE", "PASSIVE", "unset"],
        help="OMP_WAIT_POLICY (default ACTIVE: idle OpenMP threads spin instead of sleeping)",
    )
    p.add_argument(
        "--backends",
        default=None,
        help="comma-separated backend names (default: every backend available on the device)",
    )
    p.add_argument(
        "--strategies", default="max_throughput,max_throughput_per_batch,first_wins,min_latency,latency_budget"
    )
    p.add_argument("--repeats", type=int, default=None, help="round-robin rounds per measurement")
    p.add_argument("--steps", type=int, default=None, help="calls per contender per round")
    p.add_argument(
        "--cold-start-models",
        default=None,
        help="cases measured for cold start (default mlp); 'none' skips",
    )
    p.add_argument("--cold-start-repeats", type=int, default=None)
    p.add_argument(
        "--tune-time-models",
        default=None,
        help="cases whose tunes are timed cold and warm in a fresh "
        "process (default mlp,encoder; quick mlp, MaxThroughput only); 'none' skips",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--markdown", default=None, help="also write the markdown tables here")
    args = p.parse_args(argv)
    q = args.quick
    args.batch_sizes = [
        int(b) for b in (args.batch_sizes or (QUICK_BATCH_SIZES if q else DEFAULT_BATCH_SIZES)).split(",")
    ]
    args.repeats = args.repeats or (5 if q else 11)
    args.steps = args.steps or (10 if q else 30)
    args.cold_start_repeats = args.cold_start_repeats or (2 if q else 3)
    if args.cold_start_models is None:
        args.cold_start_models = "mlp"
    args.cold_start_models = [] if args.cold_start_models == "none" else args.cold_start_models.split(",")
    if args.tune_time_models is None:
        args.tune_time_models = "mlp" if q else "mlp,encoder"
    args.tune_time_models = [] if args.tune_time_models == "none" else args.tune_time_models.split(",")
    args.strategies = args.strategies.split(",")
    return args


def set_thread_env(threads: int, wait_policy: str) -> None:
    """Thread settings every library reads at load time; children inherit them."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    if wait_policy == "unset":
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = wait_policy


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if "torch" in sys.modules:  # too late for OpenMP to see the variables: start over in a clean process
        set_thread_env(args.threads, args.wait_policy)
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks", *(argv or sys.argv[1:])])
    set_thread_env(args.threads, args.wait_policy)
    from .harness import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
