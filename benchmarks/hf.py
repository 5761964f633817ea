"""Hugging Face cases next to the zoo: transformers models and a tiny diffusers pipeline.

``python -m benchmarks.hf`` (``--models bert,vit``, ``--backends onnxruntime``, ``--out r.json``);
``--peers`` runs :mod:`benchmarks.peers` instead (aitune's pick against each runtime by hand);
``--generate`` runs :mod:`benchmarks.generation` (tokens per second of greedy ``generate()``).
Per case, with an empty aitune cache: ``ait.tune`` with MaxThroughput over every backend (its wall
time is the tune time, builds included), then each backend alone (``OneBackendStrategy``, kept
whatever its speed; builds come from the cache), then eager, each backend and the pick timed in
one interleaved loop on one held-out input, and the pick's artifact size. Small configs, random
weights, nothing downloaded: the same architectures ``tests/models`` checks for correctness.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class HFCase:
    name: str
    build: Callable[[], Any]
    """A fresh model or pipeline (seeded by the caller)."""
    targets: tuple[str, ...] | None
    """Submodules to wrap; None wraps the whole model."""
    data: Callable[[], list[Any]]
    """Tuning items, then one held-out item (the last) for the timing."""
    note: str


def _tokens(sizes: list[tuple[int, int]], extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(0)
    items = []
    for batch, seq in sizes:
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[:, -1] = 0
        items.append(
            {"input_ids": torch.randint(0, 100, (batch, seq), generator=g), "attention_mask": mask, **(extra or {})}
        )
    return items


_SIZES = [(1, 16), (8, 64), (4, 32)]


def _bert() -> Any:
    import transformers

    return transformers.BertModel(
        transformers.BertConfig(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512, vocab_size=100
        )
    ).eval()


def _gpt2() -> Any:
    import transformers

    config = transformers.GPT2Config(
        n_embd=128, n_layer=2, n_head=4, vocab_size=100, n_positions=128, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval()


def _t5() -> Any:
    import transformers

    config = transformers.T5Config(d_model=128, d_kv=32, d_ff=512, num_layers=2, num_heads=4, vocab_size=100)
    return transformers.T5EncoderModel(config).eval()


def _vit() -> Any:
    import transformers

    config = transformers.ViTConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512, image_size=64, patch_size=8
    )
    return transformers.ViTModel(config).eval()


def _clip() -> Any:
    import transformers

    config = transformers.CLIPTextConfig(
        hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
        max_position_embeddings=77, bos_token_id=0, eos_token_id=2, pad_token_id=1,
    )  # fmt: skip
    return transformers.CLIPTextModel(config).eval()


class SDPipeline:
    """CLIP text encoder -> 4 UNet steps -> VAE decoder, 16x16 latents (a Stable Diffusion in miniature)."""

    def __init__(self) -> None:
        import diffusers

        self.text_encoder = _clip()
        self.unet = diffusers.UNet2DConditionModel(
            sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=128, attention_head_dim=8, norm_num_groups=32,
        ).eval()  # fmt: skip
        self.vae = diffusers.AutoencoderKL(
            block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=32,
        ).eval()  # fmt: skip

    def __call__(self, input_ids: Any) -> Any:
        import torch

        with torch.no_grad():
            text = self.text_encoder(input_ids).last_hidden_state
            g = torch.Generator().manual_seed(0)
            latents = torch.randn((input_ids.shape[0], 4, 16, 16), generator=g)
            for t in torch.linspace(999, 0, 4).long():
                latents = latents - 0.1 * self.unet(latents, t, encoder_hidden_states=text).sample
            return self.vae.decode(latents / self.vae.config.scaling_factor).sample


def _prompts() -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 100, (b, 77), generator=g) for b in (1, 2, 2)]


def _images() -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [{"pixel_values": torch.randn(b, 3, 64, 64, generator=g)} for b in (1, 8, 4)]


CASES: dict[str, HFCase] = {
    c.name: c
    for c in [
        HFCase("bert", _bert, ("encoder",), lambda: _tokens(_SIZES), "BertModel d=128, 2 layers; encoder wrapped"),
        HFCase(
            "gpt2",
            _gpt2,
            ("transformer",),
            lambda: _tokens(_SIZES, {"use_cache": False}),
            "GPT2LMHeadModel d=128, 2 layers, use_cache=False; transformer wrapped",
        ),
        HFCase("t5", _t5, ("encoder",), lambda: _tokens(_SIZES), "T5EncoderModel d=128, 2 layers; encoder wrapped"),
        HFCase("vit", _vit, None, _images, "ViTModel d=128, 2 layers, 64x64 images; wrapped whole"),
        HFCase(
            "clip_text",
            _clip,
            None,
            lambda: [{"input_ids": i["input_ids"]} for i in _tokens(_SIZES)],
            "CLIPTextModel d=128, 2 layers; wrapped whole",
        ),
        HFCase(
            "sd_pipeline",
            SDPipeline,
            ("text_encoder", "unet", "vae.decoder"),
            _prompts,
            "CLIP text + UNet2DConditionModel (4 steps) + AutoencoderKL decoder; 3 modules, whole pipeline timed",
        ),
    ]
}


def _call(obj: Any, item: Any) -> Any:
    return obj(**item) if isinstance(item, dict) else obj(item)


def _wrapped(case: HFCase, strategy: Any) -> Any:
    import torch

    import aitune.torch as ait

    torch.manual_seed(0)
    obj = case.build()
    if case.targets is None:
        return ait.Module(obj, case.name, strategy=strategy)
    return ait.wrap(obj, list(case.targets), strategy=strategy)


def run_case(case: HFCase, backends: list[str], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import torch

    import aitune.torch as ait

    from .measure import interleaved
    from .tuning import make_backend, profiling_config

    items = case.data()
    tune_items, held_out = items[:-1], items[-1]
    os.environ["AITUNE_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"cache-{case.name}-", dir=tmp)
    config = profiling_config(True, [])
    out: dict[str, Any] = {"case": case.name, "note": case.note, "alone": {}}

    start = time.perf_counter()
    pick = _wrapped(case, ait.MaxThroughputStrategy([make_backend(b, args.threads) for b in backends], config))
    report = ait.tune(lambda item: _call(pick, item), [((item,), {}) for item in tune_items])
    out["tune_s"] = time.perf_counter() - start
    out["decisions"] = {m.name: [g.decision for g in m.graphs] for m in report.modules}
    out["reasons"] = {m.name: [g.reason for g in m.graphs] for m in report.modules}
    path = ait.save(pick, tmp / f"{case.name}.ait")
    out["artifact_mb"] = path.stat().st_size / 1e6

    alone: dict[str, Any] = {}
    for name in backends:
        strategy = ait.OneBackendStrategy(make_backend(name, args.threads), profiling_config=config)
        model = _wrapped(case, strategy.enable_performance_validation(False))
        try:
            r = ait.tune(lambda item, m=model: _call(m, item), [((item,), {}) for item in tune_items])
        except Exception as exc:  # OneBackend raises the backend's own error: report it, go on
            out["alone"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            continue
        failed = [f"{m.name}: {m.error}" for m in r.modules if m.status == "failed"]
        if failed:
            out["alone"][name] = {"error": "; ".join(failed)[:300]}
            continue
        alone[name] = model
        errors = [c.validation.max_rel_error for m in r.modules for g in m.graphs for c in g.candidates if c.validation]
        builds = [c.build_time_s or 0.0 for m in r.modules for g in m.graphs for c in g.candidates]
        out["alone"][name] = {"max_rel_error": max(errors, default=None), "build_s": sum(builds)}

    torch.manual_seed(0)
    eager = case.build()
    contenders = {"eager": lambda: _call(eager, held_out), "tuned pick": lambda: _call(pick, held_out)}
    contenders.update({name: (lambda m=m: _call(m, held_out)) for name, m in alone.items()})
    out["timing_ms"] = interleaved(contenders, args.steps, args.repeats)
    return out


def _cpu() -> str:
    from aitune.machine import _cpu_model

    return _cpu_model()


def _cell(timing: dict[str, Any], name: str) -> str:
    if name not in timing:
        return "failed"
    s, eager = timing[name], timing["eager"]["median"]
    return f"{s['median']:.2f} ({eager / s['median']:.2f}x) [{s['q1']:.2f}–{s['q3']:.2f}]"


def markdown(results: dict[str, Any]) -> str:
    backends = results["backends"]
    head = ["case", "eager ms", *[f"{b} ms" for b in backends], "tuned pick ms", "pick", "tune s", "artifact MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in results["cases"]:
        t = c["timing_ms"]
        picks = "; ".join(f"{m}: {', '.join(d)}" for m, d in c["decisions"].items())
        row = [c["case"], f"{t['eager']['median']:.2f} [{t['eager']['q1']:.2f}–{t['eager']['q3']:.2f}]"]
        row += [_cell(t, b) for b in backends]
        row += [_cell(t, "tuned pick"), picks, f"{c['tune_s']:.0f}", f"{c['artifact_mb']:.1f}"]
        lines.append("| " + " | ".join(row) + " |")
    notes = [
        f"- {c['case']} / {b}: {v['error']}" for c in results["cases"] for b, v in c["alone"].items() if "error" in v
    ]
    return "\n".join(lines + (["", *notes] if notes else []))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--peers" in argv:
        from . import peers

        return peers.main([a for a in argv if a != "--peers"])
    if "--generate" in argv:
        from . import generation

        return generation.main([a for a in argv if a != "--generate"])
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf", description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--backends", default=None, help="comma-separated backend names (default: every CPU default)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if "torch" not in sys.modules:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ.setdefault(var, str(args.threads))
        os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
    import torch

    from .tuning import available_backends

    torch.set_num_threads(args.threads)
    from aitune.plugins import get_manager

    usable, _ = available_backends("cpu")
    registry = get_manager().registry
    wanted = args.backends.split(",") if args.backends else [b for b in usable if registry.spec(b).default_candidate]
    backends = [b for b in wanted if b in usable]
    results: dict[str, Any] = {"backends": backends, "threads": args.threads, "cases": []}
    cases = args.models.split(",")
    return run_all(
        "bench-hf", cases, lambda name, tmp: run_case(CASES[name], backends, args, tmp), results, markdown, args.out
    )


def run_all(
    prog: str,
    names: list[str],
    run_one: Callable[[str, Path], dict[str, Any]],
    results: dict[str, Any],
    render: Callable[[dict[str, Any]], str],
    out: str | None,
) -> int:
    """Run every case in one scratch folder, print the table, and keep the JSON when asked."""
    with tempfile.TemporaryDirectory(prefix=f"aitune-{prog}-") as tmp:
        for name in names:
            print(f"[{prog} {time.strftime('%H:%M:%S')}] {name}", file=sys.stderr, flush=True)
            results["cases"].append(run_one(name, Path(tmp)))
    results["cpu"] = _cpu()
    print(render(results))
    if out:
        Path(out).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
