"""Greedy ``generate()`` tokens per second: eager with the dynamic and with the static cache, and
the tuned model called both ways.

``python -m benchmarks.hf --generate`` (or ``python -m benchmarks.generation``): GPT-2, Llama,
Mistral (sliding window of 48 tokens, so it slides while generating) and Qwen2 from small
random-weight configs (hidden 256, 4 layers), prompt 32 tokens, 32 new tokens, batch 1 and 4, one
thread. Each model is tuned on plain ``generate()`` calls (the default cache: ``ait.tune`` switches
the model to a static one); the tuned model is then timed called plainly ("default") and with
``cache_implementation="static"``, against eager's best cache. The contenders run interleaved,
``--repeats`` rounds, each figure the median round; every tuned generation is checked to give
eager's tokens. The decoder's share of eager's time (from the tune report's end-to-end figure)
bounds what tuning it can gain (Amdahl): ``1 / (1 - share)``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PROMPT, NEW_TOKENS, BATCHES = 32, 32, (1, 4)


def _gpt2() -> tuple[Any, str]:
    import transformers

    config = transformers.GPT2Config(
        n_embd=256, n_layer=4, n_head=4, vocab_size=1000, n_positions=256, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval(), "transformer"


def _llama() -> tuple[Any, str]:
    return _decoder("LlamaForCausalLM", "LlamaConfig"), "model"


def _decoder(cls_name: str, config_name: str, **extra: Any) -> Any:
    import transformers

    config = getattr(transformers, config_name)(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=0,
        **extra,
    )
    return getattr(transformers, cls_name)(config).eval()


def _mistral() -> tuple[Any, str]:
    return _decoder("MistralForCausalLM", "MistralConfig", sliding_window=48), "model"


def _qwen2() -> tuple[Any, str]:
    return _decoder("Qwen2ForCausalLM", "Qwen2Config"), "model"


MODELS = {"gpt2": _gpt2, "llama": _llama, "mistral": _mistral, "qwen2": _qwen2}
EAGER = ("eager, dynamic cache", "eager, static cache")
TUNED = ("tuned, default", "tuned, static cache")


def _generate(model: Any, ids: Any, cache: str | None) -> Any:
    """``cache`` None: as the user calls it (the generation config decides)."""
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
        expected = {b: _generate(model, ids, "dynamic") for b, ids in prompts.items()}
    ait.wrap(model, [body])
    start = time.perf_counter()
    report = ait.tune(lambda ids: _generate(model, ids, None), list(prompts.values()), report_path=tmp / "r.json")
    tune_s = time.perf_counter() - start
    decisions = [g.decision for g in report.modules[0].graphs]
    e2e = report.end_to_end
    wrapper = getattr(model, body)
    contenders = {
        "eager, dynamic cache": lambda ids: _call_eager(wrapper, model, ids, "dynamic"),
        "eager, static cache": lambda ids: _call_eager(wrapper, model, ids, "static"),
        "tuned, default": lambda ids: _generate(model, ids, None),
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
    return {
        "model": name,
        "tune_s": tune_s,
        "decisions": decisions,
        "changes": report.changes,
        "decoder_share": e2e.shares.get(body) if e2e is not None else None,
        "rows": rows,
    }


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
        f"median of {results['repeats']}; tokens/s ({results['cpu']}; load average {results.get('load', '?')}):",
        "",
        "| model | batch | eager, dynamic cache | eager, static cache | tuned, default | tuned, static cache "
        "| tuned vs eager's best | decoder share (bound) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in results["cases"]:
        share = case.get("decoder_share")
        bound = f"{share:.0%} ({1 / (1 - share):.1f}x)" if share is not None and share < 1 else "not measured"
        for row in case["rows"]:
            best = max(row[k] for k in EAGER)
            ratios = "/".join(f"{row[k] / best:.2f}x" for k in TUNED)
            cells = " | ".join(f"{row[k]:.0f}" for k in (*EAGER, *TUNED))
            lines.append(f"| {case['model']} | {row['batch']} | {cells} | {ratios} | {bound} |")
    lines.append("")
    for case in results["cases"]:
        lines.append(f"- {case['model']}: tuned in {case['tune_s']:.0f} s; graphs: {', '.join(case['decisions'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf --generate", description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(args.threads))
    import torch

    from .hf import _cpu, run_all

    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"threads": args.threads, "repeats": args.repeats, "cases": []}
    start_load = os.getloadavg()[0]
    return run_all(
        "bench-generate",
        args.models.split(","),
        lambda name, tmp: run_model(name, args.repeats, tmp),
        results,
        lambda r: markdown(
            {
                **r,
                "cpu": r.get("cpu", _cpu()),
                "load": f"{start_load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end",
            }
        ),
        args.out,
    )


if __name__ == "__main__":
    sys.exit(main())
