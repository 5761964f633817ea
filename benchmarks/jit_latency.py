"""JIT mode's per-call latency while it tunes: what a serving loop waits for, against eager.

``python -m benchmarks.jit_latency`` serves a CNN in a loop for ``--seconds``, each mode in a fresh
process with an empty aitune cache: eager (no JIT), ``AITUNE_JIT=1`` with the default background
mode, and (``--modes``) with ``AITUNE_JIT_MODE=inline``. ``--runs`` repeats every mode. Per run:
the calls made, the median, p99, p99.9 and slowest call (with when it came), when the module
switched to its winner, the median of the last 50 calls (the tuned backend's, once switched), and
how many outputs differed from eager's. Two bars from issue 50 are judged per JIT run: the slowest
call within 20x eager's p99 (of the eager run before it), and the last 50 calls at most 0.9x
eager's median.

``--model small`` (the default) is the issue's 164k-parameter CNN at batch 4 on 32x32 inputs;
``--model cnn56`` the earlier 4-block CNN (64 channels, 56x56, batch 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

MODES = ("eager", "background")
TAIL = 50


def _model(name: str) -> Any:
    import torch

    class Block(torch.nn.Module):
        def __init__(self, channels: int) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
            self.norm = torch.nn.BatchNorm2d(channels)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.norm(self.conv(x))) + x

    class CNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = torch.nn.Conv2d(3, 64, 3, padding=1)
            self.blocks = torch.nn.Sequential(*[Block(64) for _ in range(4)])
            self.head = torch.nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(self.stem(x)).mean((2, 3)))

    class SmallCNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = torch.nn.Sequential(
                torch.nn.Conv2d(3, 32, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.MaxPool2d(2),
                torch.nn.Conv2d(32, 64, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.MaxPool2d(2),
                torch.nn.Conv2d(64, 128, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.AdaptiveAvgPool2d(1),
                torch.nn.Flatten(),
            )
            self.head = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.features(x))

    torch.manual_seed(0)
    return (SmallCNN() if name == "small" else CNN()).eval()


def _input_shape(name: str, batch: int) -> tuple[int, ...]:
    return (batch, 3, 32, 32) if name == "small" else (batch, 3, 56, 56)


def serve(seconds: float, model_name: str = "small", batch: int = 4) -> dict[str, Any]:
    """In the child: serve the model for ``seconds``, timing every call."""
    import torch

    from aitune.engine.recording import bypass  # the reference runs as aitune's own calls: never tuned

    model = _model(model_name)
    reference = _model(model_name)  # the same weights, never tuned: eager's answers
    jit = None
    if os.environ.get("AITUNE_JIT") == "1":
        from aitune.torch import jit as jit_module

        jit = jit_module
    name = type(model).__name__
    latencies, switched_at, wrong = [], None, 0
    start = time.perf_counter()
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        while time.perf_counter() - start < seconds:
            x = torch.randn(*_input_shape(model_name, batch), generator=g)
            t0 = time.perf_counter()
            y = model(x)
            latencies.append((t0 - start, time.perf_counter() - t0))
            with bypass():
                wrong += not torch.allclose(y, reference(x), atol=1e-4, rtol=1e-3)
            if jit is not None and switched_at is None and jit.status().get(name, "").startswith("tuned"):
                switched_at = time.perf_counter() - start
    times = [t for _, t in latencies]
    cuts = statistics.quantiles(times, n=1000) if len(times) > 1000 else None
    slowest_at, slowest = max(latencies, key=lambda item: item[1])
    preloaded = jit.startup() if jit is not None else None
    return {
        "calls": len(times),
        "median_ms": statistics.median(times) * 1e3,
        "p99_ms": (cuts[989] if cuts else sorted(times)[int(len(times) * 0.99)]) * 1e3,
        "p999_ms": (cuts[998] if cuts else max(times)) * 1e3,
        "max_ms": slowest * 1e3,
        "max_at_s": slowest_at,
        "switched_s": switched_at,
        "tail_median_ms": statistics.median(times[-TAIL:]) * 1e3,
        "preload_s": preloaded.seconds if preloaded is not None else None,
        "status": jit.status() if jit is not None else {},
        "wrong": wrong,
    }


def run_mode(mode: str, seconds: float, threads: int, model: str, batch: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITUNE_JIT")}
    env.update(OMP_NUM_THREADS=str(threads), AITUNE_CACHE_DIR=tempfile.mkdtemp(prefix="aitune-jit-bench-"))
    if mode != "eager":
        env.update(AITUNE_JIT="1", AITUNE_JIT_MODE=mode, AITUNE_JIT_MIN_PARAMETERS="0", AITUNE_JIT_REMEMBER="0")
    code = (
        "import json, torch, benchmarks.jit_latency as b; "
        f"torch.set_num_threads({threads}); print(json.dumps(b.serve({seconds}, {model!r}, {batch})))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=seconds * 10)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def judge(row: dict[str, Any], eager: dict[str, Any] | None) -> str:
    """The issue's two bars for a JIT run against the eager run before it."""
    if eager is None or "error" in eager or row["mode"] == "eager":
        return "-"
    stall = row["max_ms"] / eager["p99_ms"]
    tail = row["tail_median_ms"] / eager["median_ms"]
    verdict = "ok" if stall <= 20 and tail <= 0.9 and not row["wrong"] else "NOT MET"
    return f"{verdict}: slowest {stall:.1f}x eager p99, last {TAIL} {tail:.2f}x eager median"


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"{args.model} CNN served for {args.seconds:.0f} s per run, batch {args.batch}, {args.threads} thread(s), "
        "a fresh process and empty cache each:",
        "",
        "| run | mode | calls | median ms | p99 ms | p99.9 ms | slowest ms (at s) | switched at | "
        f"last {TAIL} median ms | preload s | wrong | bars |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    eager = None
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | {r['mode']} | failed: {r['error']} |")
            continue
        if r["mode"] == "eager":
            eager = r
        switched = f"{r['switched_s']:.1f} s" if r["switched_s"] is not None else "never"
        preload = f"{r['preload_s']:.2f}" if r["preload_s"] is not None else "-"
        lines.append(
            f"| {r['run']} | {r['mode']} | {r['calls']} | {r['median_ms']:.2f} | {r['p99_ms']:.2f} | {r['p999_ms']:.2f} | "
            f"{r['max_ms']:.1f} ({r['max_at_s']:.1f}) | {switched} | {r['tail_median_ms']:.2f} | {preload} | "
            f"{r['wrong']} | {judge(r, eager)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.jit_latency", description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=150.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", choices=("small", "cnn56"), default="small")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES), help="eager, background, inline")
    args = p.parse_args(argv)
    before = os.getloadavg()[0]
    rows = []
    for run in range(1, args.runs + 1):
        for mode in args.modes.split(","):
            print(f"[jit-latency {time.strftime('%H:%M:%S')}] run {run} {mode}", file=sys.stderr, flush=True)
            rows.append(
                {"run": run, "mode": mode, **run_mode(mode, args.seconds, args.threads, args.model, args.batch)}
            )
    print(f"load average (1 min): {before:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(markdown(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
