"""Greedy ``generate()`` tokens per second: eager with the dynamic and with the static cache, and
the tuned model called both ways; and where a new token's time goes in eager and tuned.

``python -m benchmarks.hf --generate`` (or ``python -m benchmarks.generation``): GPT-2, Llama,
Mistral (sliding window of 48 tokens, so it slides while generating), Qwen2, Gemma 3 (text; three
sliding-window layers and one full-attention layer) and T5 (encoder-decoder) from small
random-weight configs (hidden 256, 4 layers), prompt 32 tokens, 32 new tokens, batch 1 and 4, one
thread. Each model is tuned on plain ``generate()`` calls (the default cache: ``ait.tune`` switches
the model to a static one); the tuned model is then timed called plainly ("default") and with
``cache_implementation="static"``, against eager's best cache. The contenders run interleaved,
``--repeats`` rounds, each figure the median round; every tuned generation is checked to give
eager's tokens. Each round also runs eager (both caches) and the tuned model once more with the
timers of :mod:`.step_timing` in place, for the split: per new token the wrapped modules' calls and
the rest, per decode step the layers of a tuned call down to the Inductor-generated code, and the
most the row could gain were each eager step to cost the tuned step's Inductor code alone.
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


def _gpt2() -> tuple[Any, tuple[str, ...]]:
    import transformers

    config = transformers.GPT2Config(
        n_embd=256, n_layer=4, n_head=4, vocab_size=1000, n_positions=256, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval(), ("transformer",)


def _decoder(cls_name: str, config_name: str, **extra: Any) -> tuple[Any, tuple[str, ...]]:
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
    return getattr(transformers, cls_name)(config).eval(), ("model",)


def _llama() -> tuple[Any, tuple[str, ...]]:
    return _decoder("LlamaForCausalLM", "LlamaConfig")


def _mistral() -> tuple[Any, tuple[str, ...]]:
    return _decoder("MistralForCausalLM", "MistralConfig", sliding_window=48)


def _qwen2() -> tuple[Any, tuple[str, ...]]:
    return _decoder("Qwen2ForCausalLM", "Qwen2Config")


def _gemma3() -> tuple[Any, tuple[str, ...]]:
    """Gemma 3's text model with its hybrid cache: three sliding-window layers (48 tokens, so the
    window fills and slides while generating) and one full-attention layer."""
    layers = ["sliding_attention"] * 3 + ["full_attention"]
    return _decoder(
        "Gemma3ForCausalLM", "Gemma3TextConfig", head_dim=64, sliding_window=48, layer_types=layers, pad_token_id=0
    )


def _t5() -> tuple[Any, tuple[str, ...]]:
    """Encoder-decoder: the encoder runs once per generate(), the decoder's first call fills both
    caches (its own and the cross-attention one) and its later calls are the decode steps."""
    import transformers

    config = transformers.T5Config(
        d_model=256,
        d_kv=64,
        d_ff=688,
        num_layers=4,
        num_heads=4,
        vocab_size=1000,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return transformers.T5ForConditionalGeneration(config).eval(), ("encoder", "decoder")


MODELS = {"gpt2": _gpt2, "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "gemma3": _gemma3, "t5": _t5}
EAGER = ("eager, dynamic cache", "eager, static cache")
TUNED = ("tuned, default", "tuned, static cache")
SPLIT = ("eager, dynamic cache", "eager, static cache", "tuned, default")
"""The contenders that also run once per round with the timers of :mod:`.step_timing` in place."""


def _generate(model: Any, ids: Any, cache: str | None) -> Any:
    """``cache`` None: as the user calls it (the generation config decides)."""
    extra = {"cache_implementation": cache} if cache else {}
    return model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **extra)


def run_model(name: str, repeats: int, tmp: Path) -> dict[str, Any]:
    import torch

    import aitune.torch as ait

    torch.manual_seed(0)
    model, bodies = MODELS[name]()
    g = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(1, 1000, (b, PROMPT), generator=g) for b in BATCHES}
    with torch.no_grad():
        expected = {b: _generate(model, ids, "dynamic") for b, ids in prompts.items()}
    ait.wrap(model, list(bodies))
    start = time.perf_counter()
    report = ait.tune(lambda ids: _generate(model, ids, None), list(prompts.values()), report_path=tmp / "r.json")
    tune_s = time.perf_counter() - start
    wrappers = {path: model.get_submodule(path) for path in bodies}
    contenders = {
        "eager, dynamic cache": lambda ids: _eager(model, wrappers, ids, "dynamic"),
        "eager, static cache": lambda ids: _eager(model, wrappers, ids, "static"),
        "tuned, default": lambda ids: _generate(model, ids, None),
        "tuned, static cache": lambda ids: _generate(model, ids, "static"),
    }
    rows = []
    with torch.no_grad():
        for batch, ids in prompts.items():
            times: dict[str, list[float]] = {k: [] for k in contenders}
            splits: dict[str, list[dict[str, float]]] = {k: [] for k in SPLIT}
            for _ in range(repeats):
                for label, fn in contenders.items():
                    t0 = time.perf_counter()
                    out = fn(ids)
                    times[label].append(time.perf_counter() - t0)
                    _check(name, batch, label, out, expected[batch])
                for label in SPLIT:
                    splits[label].append(_split_round(name, model, wrappers, label, ids, expected[batch]))
            medians = {k: batch * NEW_TOKENS / statistics.median(v) for k, v in times.items()}
            best = max(EAGER, key=lambda k: medians[k])
            split = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in splits.items()}
            rows.append({"batch": batch, **medians, "best eager": best, "split": split})
    return {
        "model": name,
        "tune_s": tune_s,
        "decisions": {m.name: [g.decision for g in m.graphs] for m in report.modules},
        "changes": report.changes,
        "rows": rows,
    }


def _check(name: str, batch: int, label: str, out: Any, expected: Any) -> None:
    import torch

    if label.startswith("tuned") and not torch.equal(out, expected):
        raise SystemExit(f"{name} batch {batch}: the tuned model's tokens differ from eager's ({label})")


def _split_round(
    name: str, model: Any, wrappers: dict[str, Any], label: str, ids: Any, expected: Any
) -> dict[str, float]:
    """One generate() with the timers in place, in ms: per new token the whole call, the wrapped
    modules' calls and the rest; per decode step (the step module's calls after its first) the
    step as the model calls it, the compiled module's call and the Inductor-generated code."""
    from .step_timing import timed

    tuned = label.startswith("tuned")
    swaps = [(path, w if tuned else w.module) for path, w in wrappers.items()]
    cache = None if tuned else label.split(", ")[1].split()[0]
    with timed(model, swaps) as calls:
        t0 = time.perf_counter()
        out = _generate(model, ids, cache)
        whole = time.perf_counter() - t0
    _check(name, batch=ids.shape[0], label=label, out=out, expected=expected)
    steps = list(calls.wrapped.values())[-1][1:]  # the step module is the last wrapped: its first call fills the cache
    wrapped = sum(sum(v) for v in calls.wrapped.values())
    ms = 1e3
    return {
        "token": whole / NEW_TOKENS * ms,
        "wrapped": wrapped / NEW_TOKENS * ms,
        "rest": (whole - wrapped) / NEW_TOKENS * ms,
        "steps per token": len(steps) / NEW_TOKENS,
        "step": sum(steps) / len(steps) * ms,
        "compiled": sum(calls.compiled) / len(steps) * ms,
        "kernels": sum(calls.kernels) / len(steps) * ms,
        # 1.0 each when every step ran the compiled code once; less where steps ran eager
        "compiled calls per step": len(calls.compiled) / len(steps),
        "Inductor calls per step": len(calls.kernels) / len(steps),
    }


def _eager(model: Any, wrappers: dict[str, Any], ids: Any, cache: str | None) -> Any:
    """Generation with each wrapped module's own module in its place: eager, whatever was tuned."""
    from .step_timing import swapped

    with swapped(model, [(path, wrapper.module) for path, wrapper in wrappers.items()]):
        return _generate(model, ids, cache)


def bound(row: dict[str, Any]) -> float:
    """The most this row's whole generation could gain: eager's best with each decode step costing
    the tuned step's compiled code alone, and all else as in eager."""
    eager = row["split"][row["best eager"]]
    kernels = row["split"]["tuned, default"]["kernels"]
    saved = (eager["step"] - kernels) * eager["steps per token"]
    return eager["token"] / (eager["token"] - saved)


def _partly_eager(split: dict[str, float]) -> str:
    """A note on a tuned step that did not run the compiled code once per step (median round)."""
    compiled, inductor = split["compiled calls per step"], split["Inductor calls per step"]
    if compiled == inductor == 1:
        return ""
    return f"(compiled calls per step {compiled:.2f}, Inductor calls {inductor:.2f}) "


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Greedy generate(), prompt {PROMPT}, {NEW_TOKENS} new tokens, {results['threads']} thread(s), "
        f"median of {results['repeats']}; tokens/s ({results['cpu']}; load average {results.get('load', '?')}):",
        "",
        "| model | batch | eager, dynamic cache | eager, static cache | tuned, default | tuned, static cache "
        "| tuned vs eager's best |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in results["cases"]:
        for row in case["rows"]:
            best = row[row["best eager"]]
            ratios = " / ".join(f"{row[k] / best:.2f}x" for k in TUNED)
            cells = " | ".join(f"{row[k]:.0f}" for k in (*EAGER, *TUNED))
            lines.append(f"| {case['model']} | {row['batch']} | {cells} | {ratios} |")
    lines += [
        "",
        "Where the time goes, ms (the same rounds, with timers in place; eager at its best cache): per new "
        "token, the whole generate() = the wrapped modules' calls + the rest (generate()'s own Python and "
        "the LM head); per decode step, eager's step and the tuned step = aitune (its dispatcher and "
        "backend) + Dynamo's call (guards, wrappers) + the Inductor-generated code; the bound is eager's "
        "best over eager with each step costing the tuned step's Inductor code alone:",
        "",
        "| model | batch | eager per token | tuned per token | eager step | tuned step | tuned vs eager | bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in results["cases"]:
        for row in case["rows"]:
            e, t = row["split"][row["best eager"]], row["split"]["tuned, default"]
            cache = row["best eager"].split(", ")[1].split()[0]
            lines.append(
                f"| {case['model']} | {row['batch']} "
                f"| {e['token']:.2f} = {e['wrapped']:.2f} + {e['rest']:.2f} ({cache}) "
                f"| {t['token']:.2f} = {t['wrapped']:.2f} + {t['rest']:.2f} "
                f"| {e['step']:.2f} "
                f"| {t['step']:.2f} = {t['step'] - t['compiled']:.2f} + {t['compiled'] - t['kernels']:.2f} "
                f"+ {t['kernels']:.2f} "
                f"{_partly_eager(t)}| {e['token'] / t['token']:.2f}x | {bound(row):.2f}x |"
            )
    lines.append("")
    for case in results["cases"]:
        graphs = "; ".join(f"{m}: {', '.join(d)}" for m, d in case["decisions"].items())
        lines.append(f"- {case['model']}: tuned in {case['tune_s']:.0f} s; graphs: {graphs}")
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
    import transformers

    from .hf import _cpu, run_all

    torch.set_num_threads(args.threads)
    # unpadded prompts: transformers' per-call note that no attention mask was passed says nothing here
    transformers.logging.set_verbosity_error()
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
