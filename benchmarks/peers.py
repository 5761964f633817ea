"""aitune's pick against what a user gets from each runtime by hand, at equal threads.

``python -m benchmarks.hf --peers`` (or ``python -m benchmarks.peers``): on BERT (hidden 256, 4
layers, sequence 128, padded masks) and ViT (64 px, patch 8, hidden 192) from small configs, each
contender is tuned alone (``OneBackendStrategy``, kept whatever its speed), then eager and every
contender are timed interleaved at batch 1 and 8 on held-out inputs, under one thread budget
(``--threads``, default 1: torch's count, which ONNX Runtime's sessions follow). Contenders:
torch.compile, AOTInductor, ONNX Runtime on the dynamo and on the TorchScript export, ONNX Runtime
dynamic int8, aitune's default pick (``MaxThroughputStrategy()`` over every default candidate, both
ONNX exports included), and aitune's pick with ONNX Runtime int8 admitted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BATCHES = (1, 8)


def _bert() -> Any:
    import transformers

    config = transformers.BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, vocab_size=1000
    )
    return transformers.BertModel(config).eval()


def _vit() -> Any:
    import transformers

    config = transformers.ViTConfig(
        hidden_size=192, num_hidden_layers=4, num_attention_heads=3, intermediate_size=768, image_size=64, patch_size=8
    )
    return transformers.ViTModel(config).eval()


def _text(batch: int, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, 128, dtype=torch.long)
    mask[:, 100 + seed % 20 :] = 0  # padded: the mask varies, the graph does not
    return {"input_ids": torch.randint(0, 1000, (batch, 128), generator=g), "attention_mask": mask}


def _image(batch: int, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(batch, 3, 64, 64, generator=g)}


CASES: dict[str, tuple[Callable[[], Any], Callable[[int, int], dict[str, Any]], str]] = {
    "bert": (_bert, _text, "BertModel d=256, 4 layers, seq 128, padded masks"),
    "vit": (_vit, _image, "ViTModel d=192, 4 layers, 64x64 images, patch 8"),
}


def contenders() -> dict[str, Callable[[], Any]]:
    """Strategy factories by contender name."""
    import aitune.torch as ait
    from aitune.onnx_export import ONNXExportConfig
    from aitune.plugins import get_manager
    from aitune.torch.backend import ONNXRuntimeBackend, ONNXRuntimeBackendConfig

    registry = get_manager().registry

    def one(backend: Any) -> Callable[[], Any]:
        return lambda: ait.OneBackendStrategy(backend, performance_validation=False)

    int8 = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(quantization="dynamic_int8"))
    out: dict[str, Callable[[], Any]] = {
        "torch.compile": one(registry.backend_class("torch_inductor_jit")()),
        "AOTInductor": one(registry.backend_class("torch_inductor_aot")()),
        "ORT dynamo": one(
            ONNXRuntimeBackend(ONNXRuntimeBackendConfig(export=ONNXExportConfig(fallback_to_torchscript=False)))
        ),
        "ORT torchscript": one(
            ONNXRuntimeBackend(ONNXRuntimeBackendConfig(export=ONNXExportConfig(exporter="torchscript")))
        ),
        "ORT int8": one(int8),
        "aitune default": lambda: ait.MaxThroughputStrategy(),
    }

    def with_int8() -> Any:
        import torch

        from aitune.engine.plan import default_backends

        return ait.MaxThroughputStrategy([*default_backends(registry, torch.device("cpu")), int8])

    out["aitune + int8"] = with_int8
    return out


def run_case(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import torch

    import aitune.torch as ait

    from .measure import interleaved

    build, data, note = CASES[name]
    os.environ["AITUNE_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"cache-{name}-", dir=tmp)
    tune_items = [data(b, seed) for b in BATCHES for seed in (1, 2)]
    out: dict[str, Any] = {"case": name, "note": note, "contenders": {}, "timing_ms": {}}
    models: dict[str, Any] = {}
    for label, strategy in contenders().items():
        torch.manual_seed(0)
        model = ait.Module(build(), label, strategy=strategy())
        start = time.perf_counter()
        try:
            report = ait.tune(model, tune_items)
        except Exception as exc:
            out["contenders"][label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            continue
        graphs = report.modules[0].graphs
        picked = [next((c for c in g.candidates if c.status == "selected"), None) for g in graphs]
        out["contenders"][label] = {
            "tune_s": round(time.perf_counter() - start, 1),
            "pick": [
                f"{c.backend} ({c.variant})" if c and c.variant else (c.backend if c else "eager") for c in picked
            ],
            "max_rel_error": max((c.validation.max_rel_error for c in picked if c and c.validation), default=None),
        }
        if model.state == "tuned":
            models[label] = model
    torch.manual_seed(0)
    eager = build()
    for batch in BATCHES:
        item = data(batch, 99)
        runners = {"eager": lambda item=item: eager(**item)}
        runners.update({label: (lambda m=m, item=item: m(**item)) for label, m in models.items()})
        out["timing_ms"][str(batch)] = interleaved(runners, args.steps, args.repeats)
    return out


def markdown(results: dict[str, Any]) -> str:
    labels = list(contenders_names(results))
    head = ["case", "batch", "eager ms", *labels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in results["cases"]:
        for batch, timing in case["timing_ms"].items():
            eager = timing["eager"]["median"]
            row = [case["case"], batch, f"{eager:.2f}"]
            for label in labels:
                s = timing.get(label)
                row.append(
                    "failed"
                    if s is None
                    else f"{eager / s['median']:.2f}x [{eager / s['q3']:.2f}-{eager / s['q1']:.2f}]"
                )
            lines.append("| " + " | ".join(row) + " |")
    picks = [
        f"- {c['case']} / {label}: {v.get('pick') or v.get('error')} (max rel err {v.get('max_rel_error')})"
        for c in results["cases"]
        for label, v in c["contenders"].items()
    ]
    return "\n".join([*lines, "", *picks])


def contenders_names(results: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(label for c in results["cases"] for label in c["contenders"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(CASES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if "torch" not in sys.modules:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ.setdefault(var, str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from .hf import _cpu

    results: dict[str, Any] = {"threads": args.threads, "cases": []}
    with tempfile.TemporaryDirectory(prefix="aitune-bench-peers-") as tmp:
        for name in args.models.split(","):
            print(f"[bench-peers {time.strftime('%H:%M:%S')}] {name}", file=sys.stderr, flush=True)
            results["cases"].append(run_case(name, args, Path(tmp)))
    results["cpu"] = _cpu()
    text = markdown(results)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
