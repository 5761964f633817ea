"""aitune's pick against what a user gets from each runtime by hand, at equal threads.

``python -m benchmarks.hf --peers`` (or ``python -m benchmarks.peers``): on BERT (hidden 256, 4
layers, sequence 128, padded masks) and ViT (64 px, patch 8, hidden 192) from small configs, each
contender is tuned alone (``OneBackendStrategy``, kept whatever its speed), then eager and every
contender are timed interleaved at batch 1 and 8 on held-out inputs, under one thread budget
(``--threads``, default 1: torch's count, which ONNX Runtime's sessions follow). Contenders:
torch.compile, AOTInductor, ONNX Runtime on the dynamo and on the TorchScript export and with
transformers' eager attention, ONNX Runtime dynamic int8, aitune's default pick (``MaxThroughputStrategy()`` over every default candidate, both
ONNX exports included), and the same with an accuracy budget (``metric=cosine_similarity,
accuracy_budget=0.01``), which admits ONNX Runtime int8 among the default candidates. Two are made
the way a user would by hand, outside aitune: a TorchScript ONNX export traced from a padded sample
run by an ONNX Runtime session ("TorchScript by hand"), and AOTInductor built per batch size with
static shapes ("AOTInductor static", one build per row). The table gives the default pick's miss
against the fastest fp32 contender of each row, in %, and the load average around the run.

Where the default pick runs ONNX Runtime, the very file its session opens is also run in a plain
session, the way a user would run it by hand (``ORT_ENABLE_ALL``, the same threads, numpy in and
out): "aitune's graph by hand", timed in the same interleaved loop, and each row says how far
aitune's call of its graph is from that ("default vs its own graph"), so a per-call cost aitune
adds shows at once. Where the default picks another runtime, the graph is that of "aitune ORT"
(``MaxThroughputStrategy`` over ONNX Runtime's default candidates alone), and the row says so.
``--contenders "aitune default,aitune ORT"`` tunes those alone (minutes instead of the whole field).

That comparison is also timed call by call (``--paired``, default 100 iterations per batch size):
each iteration calls aitune's pick, its graph by hand, a second plain session on the same file and
the TorchScript export by hand once each, in an order drawn afresh (the main table's rotation keeps
one cyclic order, so each contender follows the same other one every round), and each is given as
the median of its per-iteration ratios to its graph by hand, with a 95% interval. Two plain
sessions on one file are not equally fast: each keeps an offset of its own for the whole process
(0.6-2.5% apart among four sessions in one process, measured for issue 56), so the second session's
row is the floor, and a gap of aitune's within it is no gap.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
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
        "ORT eager attention": one(
            ONNXRuntimeBackend(
                ONNXRuntimeBackendConfig(export=ONNXExportConfig(fallback_to_torchscript=False), attention="eager")
            )
        ),
        "ORT int8": one(int8),
        "aitune default": lambda: ait.MaxThroughputStrategy(),
        ORT_PICK: lambda: ait.MaxThroughputStrategy(
            [ONNXRuntimeBackend(c) for c in ONNXRuntimeBackend.default_configs()]
        ),
    }

    out["aitune + int8"] = lambda: ait.MaxThroughputStrategy()  # tuned with the accuracy budget below
    return out


STATIC = "AOTInductor static"
BY_HAND = "TorchScript by hand"
OWN_GRAPH = "aitune's graph by hand"
SECOND = "its graph, a 2nd plain session"
"""A second plain session on the file of ``OWN_GRAPH``: how far two identical sessions are apart."""
ORT_PICK = "aitune ORT"
"""aitune's pick among ONNX Runtime's default candidates alone (both exports, eager attention): the
call whose own graph is run by hand where the default pick is not ONNX Runtime."""
FP32_EXCLUDED = ("ORT int8", "aitune default", "aitune + int8", OWN_GRAPH, SECOND, ORT_PICK)
"""Not fp32 contenders of their own: the default pick's miss is measured against the others."""


def by_hand(model: Any, items: list[dict[str, Any]], threads: int, tmp: Path) -> Callable[[dict[str, Any]], Any]:
    """What a user writes by hand: ``torch.onnx.export(dynamo=False)`` traced from a padded sample
    with batch and sequence dynamic, run by an ONNX Runtime session at ``threads``."""
    import onnxruntime as ort
    import torch

    names = list(items[0])
    padded = next(i for i in items if any(bool((v == 0).any()) for k, v in i.items() if "mask" in k))

    class Positional(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *tensors: Any) -> Any:
            return self.model(**dict(zip(names, tensors))).to_tuple()

    path = tmp / "by-hand.onnx"
    axes = {n: {0: "batch", 1: "seq"} if padded[n].dim() == 2 else {0: "batch"} for n in names}
    with torch.no_grad():  # the wrapper in eval mode: the exporter restores the mode of the module it is handed
        torch.onnx.export(
            Positional().eval(), tuple(padded[n] for n in names), str(path), dynamo=False, input_names=names,
            dynamic_axes=axes,
        )  # fmt: skip
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda item: session.run(None, {n: item[n].numpy() for n in names})


def own_graph(model: Any, threads: int) -> Callable[[dict[str, Any]], Callable[[], Any] | None] | None:
    """The ONNX file that the default pick's ONNX Runtime session opens, run in a plain session by
    hand (``ORT_ENABLE_ALL``, ``threads``); None when the pick is not ONNX Runtime. With several
    graphs (batch ranges), each call runs the file of the graph its inputs fit."""
    import onnxruntime as ort

    from aitune import tree

    sessions = []
    for graph, backend in model.tuned_graphs:
        exported = getattr(backend, "exported", None)
        if backend.name != "onnxruntime" or exported is None:
            continue
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        path = str(exported.folder / exported.model)
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        sessions.append((graph, session, [i.name for i in session.get_inputs()]))
    if not sessions:
        return None

    def run(item: dict[str, Any]) -> Any:
        """The call run by hand on the graph it fits, as a function of no arguments (None: it fits
        none, its batch size went to another runtime)."""
        leaves = tree.flatten(((), item))[0]
        for graph, session, names in sessions:
            if graph.mismatch(leaves) is None:
                return lambda: session.run(None, {n: t.numpy() for n, t in zip(names, leaves)})
        return None

    return run


def paired(runners: dict[str, Callable[[], Any]], base: str, iterations: int, seed: int = 0) -> dict[str, Any]:
    """Each runner's time over ``base``'s, call by call: every iteration calls each runner once in a
    fresh random order (the call before, whose data the caches hold, is anyone's), so load that
    comes and goes hits both sides of a ratio alike. Per runner: the median of the per-iteration
    ratios minus one, in %, and its 95% interval (order statistics: no distribution assumed)."""
    import torch

    names, rng = list(runners), random.Random(seed)
    times: dict[str, list[float]] = {n: [] for n in names}
    with torch.no_grad():
        for name in names:  # warm-up
            runners[name]()
        for _ in range(iterations):
            rng.shuffle(names)
            for name in names:
                start = time.perf_counter()
                runners[name]()
                times[name].append(time.perf_counter() - start)
    out: dict[str, Any] = {}
    n = iterations
    low = max(0, math.floor(n / 2 - 0.98 * math.sqrt(n)))
    high = min(n - 1, math.ceil(n / 2 + 0.98 * math.sqrt(n)))
    for name, values in times.items():
        ratios = sorted(a / b for a, b in zip(values, times[base]))
        out[name] = {
            "pct": (statistics.median(ratios) - 1) * 100,
            "low": (ratios[low] - 1) * 100,
            "high": (ratios[high] - 1) * 100,
            "ms": statistics.median(values) * 1e3,
            "n": n,
        }
    return out


BUDGETED = {"aitune + int8": {"metric": "cosine_similarity", "accuracy_budget": 0.01}}
"""Contenders tuned with a metric and an accuracy budget (which admits ONNX Runtime int8 by default)."""


def run_case(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import torch

    import aitune.torch as ait

    from .measure import interleaved

    build, data, note = CASES[name]
    os.environ["AITUNE_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"cache-{name}-", dir=tmp)
    tune_items = [data(b, seed) for b in BATCHES for seed in (1, 2)]
    out: dict[str, Any] = {"case": name, "note": note, "contenders": {}, "timing_ms": {}}
    models: dict[str, Any] = {}
    chosen = contenders()
    if args.contenders:
        chosen = {k: v for k, v in chosen.items() if k in args.contenders.split(",")}
    for label, strategy in chosen.items():
        torch.manual_seed(0)
        model = ait.Module(build(), label, strategy=strategy())
        start = time.perf_counter()
        from aitune import metrics

        budget = BUDGETED.get(label, {})
        kwargs = (
            {"metric": getattr(metrics, budget["metric"]), "accuracy_budget": budget["accuracy_budget"]}
            if budget
            else {}
        )
        try:
            report = ait.tune(model, tune_items, **kwargs)
        except Exception as exc:
            out["contenders"][label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            continue
        graphs = report.modules[0].graphs
        picked = [next((c for c in g.candidates if c.status == "selected"), None) for g in graphs]
        out["contenders"][label] = {
            "tune_s": round(time.perf_counter() - start, 1),
            "pick": [c.label if c else "eager" for c in picked],
            "max_rel_error": max((c.validation.max_rel_error for c in picked if c and c.validation), default=None),
        }
        if model.state == "tuned":
            models[label] = model
    owners = [
        (label, own_graph(models[label], args.threads), own_graph(models[label], args.threads))
        for label in ("aitune default", ORT_PICK)
        if label in models
    ]
    owners = [(label, own, second) for label, own, second in owners if own is not None and second is not None]
    out["own_graph_of"], out["paired"] = {}, {}
    static: dict[int, Any] = {}
    if "torch_inductor_aot" in ait_backends() and "AOTInductor" in chosen:
        for batch in BATCHES:
            torch.manual_seed(0)
            model = ait.Module(build(), f"{STATIC} {batch}", strategy=contenders()["AOTInductor"]())
            ait.tune(model, [data(batch, seed) for seed in (1, 2)], batch_sizes=[batch])  # one static shape
            if model.state == "tuned":
                static[batch] = model
    torch.manual_seed(0)
    eager = build()
    hand = None
    if "attention_mask" in tune_items[0]:  # the by-hand export this row is about: a padded-mask trace
        try:
            hand = by_hand(eager, tune_items, args.threads, tmp)
            error = by_hand_error(hand, eager, [data(batch, 99) for batch in BATCHES])
            out["contenders"][BY_HAND] = {
                "pick": ["onnxruntime session on torch.onnx.export(dynamo=False)"],
                "max_rel_error": error,
                "wrong": error > 1e-3,
            }
        except Exception as exc:
            out["contenders"][BY_HAND] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if static:
        out["contenders"][STATIC] = {"pick": [f"torch_inductor_aot, batch {b} only" for b in static]}
    out["load_before"] = os.getloadavg()
    for batch in BATCHES:
        item = data(batch, 99)
        runners = {"eager": lambda item=item: eager(**item)}
        runners.update({label: (lambda m=m, item=item: m(**item)) for label, m in models.items()})
        if batch in static:
            runners[STATIC] = lambda m=static[batch], item=item: m(**item)
        if hand is not None:
            runners[BY_HAND] = lambda item=item: hand(item)
        pair: dict[str, Callable[[], Any]] = {}
        for label, own, second in owners:  # the default pick's graph where it runs ONNX Runtime, else ORT's pick's
            mine, again = own(item), second(item)
            if mine is not None and again is not None:
                runners[OWN_GRAPH] = mine
                out["own_graph_of"][str(batch)] = label
                out["contenders"][OWN_GRAPH] = {"pick": ["onnxruntime session on the ONNX file aitune's session opens"]}
                pair = {label: runners[label], OWN_GRAPH: mine, SECOND: again}
                if BY_HAND in runners:
                    pair[BY_HAND] = runners[BY_HAND]
                break
        out["timing_ms"][str(batch)] = interleaved(runners, args.steps, args.repeats)
        if pair and args.paired:
            out["paired"][str(batch)] = paired(pair, OWN_GRAPH, args.paired)
    out["load_after"] = os.getloadavg()
    return out


def by_hand_error(run: Callable[[dict[str, Any]], Any], eager: Any, items: list[dict[str, Any]]) -> float:
    """The by-hand model's largest error against eager, relative to each output's scale, on the
    timed inputs (padded otherwise than its trace sample): nobody validated it."""
    import torch

    worst = 0.0
    for item in items:
        with torch.no_grad():
            expected = eager(**item).to_tuple()
        for got, want in zip(run(item), expected):
            scale = float(want.abs().max()) or 1.0
            worst = max(worst, float((torch.from_numpy(got) - want).abs().max()) / scale)
    return worst


def ait_backends() -> list[str]:
    from aitune.plugins import get_manager

    registry = get_manager().registry
    return [n for n in registry.names() if not registry.status(n).reason("cpu")]


def miss(timing: dict[str, Any], wrong: tuple[str, ...] = ()) -> str:
    """How much slower the default pick runs than the fastest fp32 contender of the row, in %
    (contenders whose answers are ``wrong`` are no contenders)."""
    excluded = ("eager", *FP32_EXCLUDED, *wrong)
    fp32 = {k: v["median"] for k, v in timing.items() if k not in excluded}
    mine = timing.get("aitune default")
    if not fp32 or mine is None:
        return ""
    best = min(fp32, key=fp32.__getitem__)
    behind = (mine["median"] / fp32[best] - 1) * 100
    return f"{behind:+.0f}% vs {best}" if behind > 0 else "fastest"


def own_gap(timing: dict[str, Any], owner: str = "aitune default") -> str:
    """How much slower aitune's call of its pick (``owner``'s) runs than the same ONNX file in a plain
    session, in % of the medians (negative: faster)."""
    mine, own = timing.get(owner), timing.get(OWN_GRAPH)
    if mine is None or own is None:
        return ""
    gap = f"{(mine['median'] / own['median'] - 1) * 100:+.1f}%"
    return gap if owner == "aitune default" else f"{gap} ({owner})"


def markdown(results: dict[str, Any]) -> str:
    labels = list(contenders_names(results))
    head = ["case", "batch", "eager ms", *labels, "default's miss", "default vs its own graph"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in results["cases"]:
        for batch, timing in case["timing_ms"].items():
            eager = timing["eager"]["median"]
            row = [case["case"], batch, f"{eager:.2f}"]
            for label in labels:
                s = timing.get(label)
                if s is not None:
                    row.append(f"{eager / s['median']:.2f}x [{eager / s['q3']:.2f}-{eager / s['q1']:.2f}]")
                elif label in (OWN_GRAPH, SECOND):  # the pick runs another runtime at this size: no file to open
                    row.append("no ONNX Runtime graph at this size")
                else:
                    row.append("failed")
            wrong = tuple(k for k, v in case["contenders"].items() if v.get("wrong"))
            row.append(miss(timing, wrong))
            row.append(own_gap(timing, case.get("own_graph_of", {}).get(batch, "aitune default")))
            lines.append("| " + " | ".join(row) + " |")
    rows = [(c["case"], batch, p) for c in results["cases"] for batch, p in c.get("paired", {}).items()]
    if rows:
        lines += ["", paired_table(rows)]
    picks = [
        f"- {c['case']} / {label}: {v.get('pick') or v.get('error')} (max rel err {v.get('max_rel_error')})"
        for c in results["cases"]
        for label, v in c["contenders"].items()
    ]
    loads = [
        f"- {c['case']}: load average (1, 5, 15 min) {c.get('load_before')} before timing, {c.get('load_after')} after"
        for c in results["cases"]
    ]
    return "\n".join([*lines, "", *picks, *loads])


def paired_table(rows: list[tuple[str, str, dict[str, Any]]]) -> str:
    """The call-by-call comparison with aitune's graph by hand: % slower than it [95% interval]."""
    labels = list(dict.fromkeys(label for _, _, p in rows for label in p if label != OWN_GRAPH))
    head = ["case", "batch", f"{OWN_GRAPH} ms", *(f"{label} vs it" for label in labels), "iterations"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, batch, p in rows:
        cells = [
            f"{p[label]['pct']:+.1f}% [{p[label]['low']:+.1f}, {p[label]['high']:+.1f}]" if label in p else ""
            for label in labels
        ]
        lines.append(
            "| " + " | ".join([case, batch, f"{p[OWN_GRAPH]['ms']:.2f}", *cells, str(p[OWN_GRAPH]["n"])]) + " |"
        )
    return "\n".join(lines)


def contenders_names(results: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(label for c in results["cases"] for label in c["contenders"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(CASES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--paired", type=int, default=100, help="call-by-call iterations against aitune's graph by hand (0: none)"
    )
    p.add_argument("--contenders", default="", help="comma-separated contender names to tune (default: all)")
    args = p.parse_args(argv)
    if "torch" not in sys.modules:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ.setdefault(var, str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from .hf import run_all

    results: dict[str, Any] = {"threads": args.threads, "cases": []}
    cases = args.models.split(",")
    return run_all("bench-peers", cases, lambda name, tmp: run_case(name, args, tmp), results, markdown, args.out)


if __name__ == "__main__":
    sys.exit(main())
