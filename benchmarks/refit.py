"""New weights into a tuned model: refit against rebuild against eager fallback, per backend.

``python -m benchmarks.refit`` (``--threads 2``): a BERT encoder from a small config (hidden 256,
4 layers, sequence 64, batch 4, random weights), tuned with each refittable backend alone
(``OneBackendStrategy``). Then a second set of weights is loaded (``load_state_dict``), as a
fine-tune of the same base would be: the refit's time (loading the weights into the payload and
the check against eager that follows) against the build's time (a fresh tune of the new weights,
with an empty build cache), and the call's latency refitted against eager (what the old
behaviour, running eager after a weight change, served).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

BACKENDS = ("onnxruntime", "torch_inductor_aot")


def _bert(seed: int) -> Any:
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, vocab_size=1000
    )
    return transformers.BertModel(config).eval()


def _latency_ms(fn: Any, repeats: int = 30) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run(name: str) -> dict[str, Any]:
    import torch

    import aitune.torch as ait
    from aitune.plugins import get_manager

    os.environ["AITUNE_CACHE_DIR"] = tempfile.mkdtemp(prefix="aitune-refit-bench-")  # builds are timed cold
    registry = get_manager().registry
    if registry.status(name).reason("cpu"):
        return {"backend": name, "error": registry.status(name).reason("cpu")}
    ids = torch.randint(0, 1000, (4, 64))
    data = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]

    def tune(seed: int) -> tuple[Any, float]:
        model = _bert(seed)
        strategy = ait.OneBackendStrategy(registry.backend_class(name)(), performance_validation=False)
        ait.wrap(model, ["encoder"], strategy=strategy)
        start = time.perf_counter()
        ait.tune(model, data, end_to_end=False)
        return model, time.perf_counter() - start

    model, _ = tune(0)
    new = _bert(1).state_dict()
    start = time.perf_counter()
    model.load_state_dict(new)
    refit_s = time.perf_counter() - start
    stale = model.encoder.stale_reason
    _, rebuild_s = tune(1)
    with torch.no_grad():
        tuned_ms = _latency_ms(lambda: model(**data[0]))
        with ait_bypass():
            eager_ms = _latency_ms(lambda: model(**data[0]))
    return {
        "backend": name,
        "refit_s": refit_s,
        "rebuild_s": rebuild_s,
        "refitted_ms": tuned_ms,
        "eager_ms": eager_ms,
        "stale": stale,
    }


def ait_bypass() -> Any:
    from aitune.engine.recording import bypass

    return bypass()  # every wrapper calls through: what a module gone stale serves


def markdown(rows: list[dict[str, Any]], threads: int) -> str:
    lines = [
        f"BERT encoder (hidden 256, 4 layers), batch 4, sequence 64, {threads} thread(s): new weights by "
        "load_state_dict",
        "",
        "| backend | refit s (incl. check) | rebuild s (fresh tune) | refit vs rebuild | call ms refitted | call ms eager (old fallback) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | not run: {r['error']} |")
            continue
        if r["stale"]:
            lines.append(f"| {r['backend']} | refit failed: {r['stale']} |")
            continue
        saved = 1 - r["refit_s"] / r["rebuild_s"]
        lines.append(
            f"| {r['backend']} | {r['refit_s']:.2f} | {r['rebuild_s']:.1f} | {saved:.0%} less time | "
            f"{r['refitted_ms']:.2f} | {r['eager_ms']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.refit", description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backends", default=",".join(BACKENDS))
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    for name in args.backends.split(","):
        print(f"[refit {time.strftime('%H:%M:%S')}] {name}", file=sys.stderr, flush=True)
        rows.append(run(name))
    print(markdown(rows, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
