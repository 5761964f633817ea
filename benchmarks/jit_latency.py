"""JIT mode's per-call latency while it tunes: inline against background against eager.

``python -m benchmarks.jit_latency`` (``--seconds 120``, ``--threads 2``): a small CNN (4 conv
blocks, 64 channels, 56x56 input, batch 1) served in a loop for ``--seconds``, each mode in a
fresh process with an empty aitune cache: eager (no JIT), ``AITUNE_JIT=1`` with
``AITUNE_JIT_MODE=inline`` and with the default background mode. Per mode: the calls made, the
median, p99 and max latency over the whole window, when the module switched to its winner, and
the median after the switch; every call's output is checked against eager's.
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

MODES = ("eager", "inline", "background")


def _model() -> Any:
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

    torch.manual_seed(0)
    return CNN().eval()


def serve(seconds: float) -> dict[str, Any]:
    """In the child: serve the CNN for ``seconds``, timing every call."""
    import torch

    from aitune.engine.recording import bypass  # the reference runs as aitune's own calls: never tuned

    model = _model()
    reference = _model()  # the same weights, never tuned: eager's answers
    jit = None
    if os.environ.get("AITUNE_JIT") == "1":
        from aitune.torch import jit as jit_module

        jit = jit_module
    latencies, switched_at, wrong = [], None, 0
    start = time.perf_counter()
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        while time.perf_counter() - start < seconds:
            x = torch.randn(1, 3, 56, 56, generator=g)
            t0 = time.perf_counter()
            y = model(x)
            latencies.append((t0 - start, time.perf_counter() - t0))
            with bypass():
                wrong += not torch.allclose(y, reference(x), atol=1e-4, rtol=1e-3)
            if jit is not None and switched_at is None and jit.status().get("CNN", "").startswith("tuned"):
                switched_at = time.perf_counter() - start
    times = [t for _, t in latencies]
    after = [t for at, t in latencies if switched_at is not None and at > switched_at]
    return {
        "calls": len(times),
        "median_ms": statistics.median(times) * 1e3,
        "p99_ms": statistics.quantiles(times, n=100)[98] * 1e3 if len(times) > 100 else max(times) * 1e3,
        "max_ms": max(times) * 1e3,
        "switched_s": switched_at,
        "median_after_ms": statistics.median(after) * 1e3 if after else None,
        "status": jit.status() if jit is not None else {},
        "wrong": wrong,
    }


def run_mode(mode: str, seconds: float, threads: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITUNE_JIT")}
    env.update(OMP_NUM_THREADS=str(threads), AITUNE_CACHE_DIR=tempfile.mkdtemp(prefix="aitune-jit-bench-"))
    if mode != "eager":
        env.update(AITUNE_JIT="1", AITUNE_JIT_MODE=mode, AITUNE_JIT_MIN_PARAMETERS="0", AITUNE_JIT_REMEMBER="0")
    code = f"import json, benchmarks.jit_latency as b; print(json.dumps(b.serve({seconds})))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=seconds * 10)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return {"mode": mode, **json.loads(done.stdout.strip().splitlines()[-1])}


def markdown(rows: list[dict[str, Any]], seconds: float, threads: int) -> str:
    lines = [
        f"CNN served for {seconds:.0f} s per mode, batch 1, {threads} thread(s), a fresh process and empty cache each:",
        "",
        "| mode | calls | median ms | p99 ms | max ms | switched at | median after switch ms | wrong outputs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('mode', '?')} | failed: {r['error']} |")
            continue
        switched = f"{r['switched_s']:.1f} s" if r["switched_s"] is not None else "never"
        after = f"{r['median_after_ms']:.2f}" if r["median_after_ms"] is not None else "-"
        lines.append(
            f"| {r['mode']} | {r['calls']} | {r['median_ms']:.2f} | {r['p99_ms']:.2f} | {r['max_ms']:.0f} | "
            f"{switched} | {after} | {r['wrong']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.jit_latency", description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args(argv)
    rows = []
    for mode in args.modes.split(","):
        print(f"[jit-latency {time.strftime('%H:%M:%S')}] {mode}", file=sys.stderr, flush=True)
        rows.append({"mode": mode, **run_mode(mode, args.seconds, args.threads)})
    print(markdown(rows, args.seconds, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
