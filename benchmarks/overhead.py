"""What the ``ait.Module`` wrapper costs per call: dispatch and guard, with a backend that costs nothing.

``python -m benchmarks.overhead`` installs a backend whose ``infer`` returns a ready tensor on two
small modules (one positional tensor; three keyword tensors with dynamic batch and sequence, as a
BERT call, once with the values a tune records, so the per-call check of ids eager would refuse
runs, and once without, so the difference is that check's cost), then times, in turns, calling that ``infer`` directly and calling the tuned
``ait.Module`` (under ``torch.inference_mode()``, and under ``torch.no_grad()``). The per-call cost is
the median over rounds of the difference within a round; the machine and its load average before and
after are printed with it, since a busy machine inflates the figure. ``--backend NAME`` also tunes
``Linear(16, 16)`` on that backend and reports the wrapper over its real ``infer``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import aitune.torch as ait
from aitune.backend import Backend, BuildContext, LoadContext
from aitune.engine.install import install
from aitune.engine.plan import table_rows
from aitune.engine.recording import GraphRecording
from aitune.graph import Sample, infer_graph


class ConstantBackend(Backend):
    """A winner whose ``infer`` costs nothing: what is left of a call is the wrapper's own work."""

    name = "constant"

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        raise NotImplementedError("installed directly, never built")

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        return self.output

    def save(self, directory: Path) -> dict[str, Any]:
        raise NotImplementedError("never saved")

    def load(self, module: torch.nn.Module, directory: Path, context: LoadContext) -> None:
        raise NotImplementedError("never loaded")


class Encoder(torch.nn.Module):
    """A BERT-shaped call: token ids, attention mask and token types, batch and sequence dynamic."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 16)
        self.types = torch.nn.Embedding(2, 16)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        return (self.embed(input_ids) + self.types(token_type_ids)) * attention_mask.unsqueeze(-1)


def bert_call(batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 50, (batch, seq))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}


def constant_module(case: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """A wrapped module with the constant backend installed: its call, and the backend's called directly."""
    if case == "linear":
        module: torch.nn.Module = torch.nn.Linear(16, 16).eval()
        samples = [Sample((torch.randn(b, 16),)) for b in (1, 4)]
        call: tuple[tuple[Any, ...], dict[str, Any]] = ((torch.randn(1, 16),), {})
        names: tuple[str, ...] = ("input",)
    else:
        module = Encoder().eval()
        samples = [Sample((), bert_call(b, s)) for b, s in ((1, 16), (4, 128))]
        call = ((), bert_call(1, 128))
        names = ("input_ids", "attention_mask", "token_type_ids")
    wrapped = ait.Module(module, case)
    graph = infer_graph(samples, names, batch_sizes=[1, 4])
    if case == "bert":  # as a tune records them: ids checked against 0..99, token types 0..1, the mask for >= 0
        graph = graph.with_rows(table_rows(GraphRecording(samples=samples), module))
    elif case == "bert-unchecked":  # no recorded values: no input is checked
        graph = graph.without_values()
    with torch.no_grad():
        backend = ConstantBackend(module(*call[0], **call[1]))
    install(wrapped, [(graph, backend)], None)
    args, kwargs = call
    return lambda: wrapped(*args, **kwargs), lambda: backend.infer(*args, **kwargs)


def per_call_us(wrapped: Callable[[], Any], direct: Callable[[], Any], rounds: int, calls: int) -> dict[str, float]:
    """Microseconds the wrapped call adds over the direct one: the median over rounds of each
    round's difference (the two take turns, so a slow spell hits both), and its quartiles.

    Measured in this thread's CPU time (``time.thread_time``), which leaves out the time the OS
    gave other processes: on a busy machine wall time inflates every figure by the load, CPU time
    much less (caches and clock speed still suffer). The wall-time difference is reported too.
    """
    for _ in range(200):
        wrapped(), direct()
    cpu: list[float] = []
    wall: list[float] = []
    whole: list[float] = []
    pairs = (("wrapped", wrapped), ("direct", direct))
    for r in range(rounds):
        timed = {}
        for name, fn in pairs if r % 2 == 0 else pairs[::-1]:
            c0, w0 = time.thread_time(), time.perf_counter()
            for _ in range(calls):
                fn()
            timed[name] = ((time.thread_time() - c0) / calls * 1e6, (time.perf_counter() - w0) / calls * 1e6)
        cpu.append(timed["wrapped"][0] - timed["direct"][0])
        wall.append(timed["wrapped"][1] - timed["direct"][1])
        whole.append(timed["wrapped"][0])
    q1, median, q3 = statistics.quantiles(cpu, n=4, method="inclusive")
    return {
        "us": median,
        "q1": q1,
        "q3": q3,
        "wall_us": statistics.median(wall),
        "wrapped_us": statistics.median(whole),
    }


def machine() -> dict[str, Any]:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model or "unknown",
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }


def real_backend(name: str) -> dict[str, float]:
    """Linear(16, 16) tuned on ``name`` alone: the wrapper over that backend's own ``infer``."""
    from aitune.plugins import get_manager

    backend = get_manager().registry.backend_class(name)()
    model = ait.Module(
        torch.nn.Linear(16, 16).eval(), "linear", strategy=ait.OneBackendStrategy(backend, performance_validation=False)
    )
    ait.tune(model, [torch.randn(1, 16), torch.randn(4, 16)], batch_sizes=[1, 4])
    if not model.tuned_graphs or model.tuned_graphs[0].backend.name != name:
        raise SystemExit(f"{name} did not tune Linear(16, 16): {model.report}")
    infer = model.tuned_graphs[0].backend.infer
    x = torch.randn(1, 16)
    with torch.inference_mode():
        return per_call_us(lambda: model(x), lambda: infer(x), rounds=31, calls=2000)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__)
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--calls", type=int, default=2000, help="calls per contender per round")
    p.add_argument("--backend", default=None, help="also measure over this backend's real infer (tunes Linear)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[str, Any] = {"machine": machine(), "load_before": os.getloadavg(), "rows": []}
    for case in CASES:
        call, direct = constant_module(case)
        for mode in (torch.inference_mode, torch.no_grad):
            with mode():
                row = per_call_us(call, direct, args.rounds, args.calls)
            results["rows"].append({"case": case, "mode": mode.__name__, **row})
    if args.backend:
        results["rows"].append(
            {"case": f"linear over {args.backend}", "mode": "inference_mode", **real_backend(args.backend)}
        )
    results["load_after"] = os.getloadavg()
    print(markdown(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


CASES = {
    "linear": "Linear(16, 16), one positional tensor (1, 16)",
    "bert": "three keyword tensors (1, 128), batch and sequence dynamic",
    "bert-unchecked": "the same, no values recorded (no id check)",
}


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"{m['cpu']}, {m['cores']} cores; torch {m['torch']}, python {m['python']}, {m['torch_threads']} torch thread; "
        f"load average (1, 5, 15 min) {_load(results['load_before'])} before, {_load(results['load_after'])} after",
        "",
        "| call | mode | wrapper, CPU µs per call (quartiles) | wrapper, wall µs | whole wrapped call, CPU µs |",
        "|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        case = CASES.get(r["case"], r["case"])
        lines.append(
            f"| {case} | {r['mode']} | {r['us']:.2f} ({r['q1']:.2f}–{r['q3']:.2f}) | {r['wall_us']:.2f} | {r['wrapped_us']:.2f} |"
        )
    return "\n".join(lines)


def _load(values: Any) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


if __name__ == "__main__":
    raise SystemExit(main())
