"""One cold ``ait.tune`` of the peers BERT with the default strategy, and where its time went.

``python -m benchmarks.cold_tune [int8]`` in a fresh process with fresh caches, e.g.
``AITUNE_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) OMP_NUM_THREADS=1``:
``benchmarks.peers`` tunes every contender in one process with one build cache, so its default
row's tune time profits from the contenders tuned before it; this is the time a user's first tune
takes. ``int8`` tunes with the accuracy budget of the peers table (cosine similarity, 0.01).
"""

import json
import sys
import time

import torch

import aitune.torch as ait
from aitune import metrics
from benchmarks.peers import BATCHES, _bert, _text


def main(argv: list[str]) -> None:
    budget = argv == ["int8"]
    torch.manual_seed(0)
    model = ait.Module(_bert(), "bert", strategy=ait.MaxThroughputStrategy())
    items = [_text(b, seed) for b in BATCHES for seed in (1, 2)]
    kwargs = {"metric": metrics.cosine_similarity, "accuracy_budget": 0.01} if budget else {}
    start = time.perf_counter()
    report = ait.tune(model, items, **kwargs)
    wall = time.perf_counter() - start
    picked = [
        next(
            (c.label for c in g.candidates if c.status == "selected"),
            "eager",
        )
        for g in report.modules[0].graphs
    ]
    spent = {k: round(v, 1) for k, v in report.time_spent.items()}
    steps = {
        c.label: {p.batch_size: p.steps for p in c.profiles} for g in report.modules[0].graphs for c in g.candidates
    }
    seconds = {
        c.label: {
            "status": c.status,
            **{
                k: round(t, 1) for k in ("build", "validate", "profile") if (t := getattr(c, f"{k}_time_s")) is not None
            },
        }
        for g in report.modules[0].graphs
        for c in g.candidates
    }
    print(
        json.dumps(
            {
                "wall_s": round(wall, 1),
                "duration_s": round(report.duration_s, 1),
                "pick": picked,
                "time_spent": spent,
                "steps": steps,
                "candidates_s": seconds,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
