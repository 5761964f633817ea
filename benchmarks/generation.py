"""Greedy ``generate()`` tokens per second: eager with the dynamic cache, eager with the static
cache, and the tuned model (static cache, decode step tuned by aitune's default strategy).

``python -m benchmarks.hf --generate`` (or ``python -m benchmarks.generation``): GPT-2 and Llama
from small random-weight configs (hidden 256, 4 layers), prompt 32 tokens, 64 new tokens, batch 1
and 4. The three contenders run interleaved, ``--repeats`` rounds, and each figure is the median
round; every tuned generation is checked to give eager's tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PROMPT, NEW_TOKENS, BATCHES = 32, 64, (1, 4)


def _gpt2() -> tuple[Any, str]:
    import transformers

    config = transformers.GPT2Config(
        n_embd=256, n_layer=4, n_head=4, vocab_size=1000, n_positions=256, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval(), "transformer"


def _llama() -> tuple[Any, str]:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval(), "model"


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _generate(model: Any, ids: Any, cache: str | None) -> Any:
    extra = {"cache_implementation": cache} if cache else {}
    return model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **extra)


def run_model(name: str, repeats: int, tmp: Path) -> dict[str, Any]:
    import torch

    import aitune.torch as ait

    torch.manual_seed(0)
    model, body = MODELS[name]()
    g = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(1, 1000, (b, PROMPT), generator=g) for b in BATCHES}
    with torch.no_grad():
        expected = {b: _generate(model, ids, "static") for b, ids in prompts.items()}
    ait.wrap(model, [body])
    start = time.perf_counter()
    report = ait.tune(lambda ids: _generate(model, ids, "static"), list(prompts.values()), report_path=tmp / "r.json")
    tune_s = time.perf_counter() - start
    decisions = [g.decision for g in report.modules[0].graphs]
    wrapper = getattr(model, body)
    contenders = {
        "eager, dynamic cache": lambda ids: _call_eager(wrapper, model, ids, None),
        "eager, static cache": lambda ids: _call_eager(wrapper, model, ids, "static"),
        "tuned, static cache": lambda ids: _generate(model, ids, "static"),
    }
    rows = []
    with torch.no_grad():
        for batch, ids in prompts.items():
            times: dict[str, list[float]] = {k: [] for k in contenders}
            for _ in range(repeats):
                for label, fn in contenders.items():
                    t0 = time.perf_counter()
                    out = fn(ids)
                    times[label].append(time.perf_counter() - t0)
                    if label.startswith("tuned") and not torch.equal(out, expected[batch]):
                        raise SystemExit(f"{name} batch {batch}: the tuned model's tokens differ from eager's")
            rows.append({"batch": batch, **{k: batch * NEW_TOKENS / statistics.median(v) for k, v in times.items()}})
    return {"model": name, "tune_s": tune_s, "decisions": decisions, "rows": rows}


def _call_eager(wrapper: Any, model: Any, ids: Any, cache: str | None) -> Any:
    """Generation with the wrapped body's own module in its place: eager, whatever was tuned."""
    import aitune.torch as ait

    parent, attr = model, next(n for n, m in model.named_children() if m is wrapper)
    setattr(parent, attr, wrapper.module)
    try:
        return _generate(model, ids, cache)
    finally:
        setattr(parent, attr, wrapper)
        assert isinstance(getattr(parent, attr), ait.Module)


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Greedy generate(), prompt {PROMPT}, {NEW_TOKENS} new tokens, {results['threads']} thread(s), "
        f"median of {results['repeats']}; tokens/s ({results['cpu']}):",
        "",
        "| model | batch | eager, dynamic cache | eager, static cache | tuned, static cache | tuned vs eager dynamic |",
        "|---|---|---|---|---|---|",
    ]
    for case in results["cases"]:
        for row in case["rows"]:
            ratio = row["tuned, static cache"] / row["eager, dynamic cache"]
            lines.append(
                f"| {case['model']} | {row['batch']} | {row['eager, dynamic cache']:.0f} | "
                f"{row['eager, static cache']:.0f} | {row['tuned, static cache']:.0f} | {ratio:.2f}x |"
            )
    lines.append("")
    for case in results["cases"]:
        lines.append(f"- {case['model']}: tuned in {case['tune_s']:.0f} s; graphs: {', '.join(case['decisions'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf --generate", description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(args.threads))
    import torch

    from .hf import _cpu, run_all

    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"threads": args.threads, "repeats": args.repeats, "cases": []}
    return run_all(
        "bench-generate",
        args.models.split(","),
        lambda name, tmp: run_model(name, args.repeats, tmp),
        results,
        lambda r: markdown({**r, "cpu": r.get("cpu", _cpu())}),
        args.out,
    )


if __name__ == "__main__":
    sys.exit(main())
