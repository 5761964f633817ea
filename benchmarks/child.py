"""What runs in a fresh process: cold starts and cold/warm tunes.

``python -m benchmarks.child <kind> '<json>'`` prints one JSON line (its own phase timings); the
parent times the whole process from outside, the same way for every kind.
"""

from __future__ import annotations

import json
import sys
import time

T0 = time.perf_counter()


def _first_call(case, model, device):  # type: ignore[no-untyped-def]
    import torch

    x = case.inputs(1, device)
    with torch.no_grad():
        model(x)


def cold_start(kind: str, spec: dict) -> dict:
    """Build the model the way a service would at start-up, and make its first call."""
    import torch
    from safetensors.torch import load_file

    from .models import fastpath, get

    case, device = get(spec["case"]), spec["device"]
    imported = time.perf_counter()
    model = case.build(device)
    with fastpath(case.fastpath):
        if kind == "aitune":
            import aitune.torch as ait

            from .tuning import wrap

            model = wrap(case, model, None)
            # this run built it; unpinned and unsigned, so check=True compares each payload with eager once
            ait.load(model, spec["artifact"], trust_native_code=True, check=spec.get("check", True))
        else:
            model.load_state_dict(load_file(spec["weights"]))
            if kind == "compile":
                if case.targets is None:
                    model = torch.compile(model)
                else:
                    for name in case.targets:
                        setattr(model, name, torch.compile(getattr(model, name)))
        ready = time.perf_counter()
        _first_call(case, model, device)
    done = time.perf_counter()
    return {"import_s": imported - T0, "ready_s": ready - imported, "first_call_s": done - ready}


def tune_time(spec: dict) -> dict:
    """A cold tune (empty cache, nothing compiled in this process yet), then the same tune again."""
    from .models import get
    from .tuning import make_strategy, tune

    case = get(spec["case"])

    def strategy():  # type: ignore[no-untyped-def]
        return make_strategy(
            spec["strategy"], spec["backends"], spec["threads"], spec["quick"], spec["batch_sizes"], spec["budget_ms"]
        )

    out = {}
    for phase in ("cold", "warm"):
        tuned = tune(case, strategy(), spec["batch_sizes"], spec["device"])
        cached = 0
        if tuned.report is not None:
            cached = sum(c.from_cache for m in tuned.report.modules for g in m.graphs for c in g.candidates)
        out[phase] = {"wall_s": tuned.wall_s, "error": tuned.error, "decisions": tuned.decisions, "from_cache": cached}
    return out


def main() -> None:
    kind, spec = sys.argv[1], json.loads(sys.argv[2])
    result = tune_time(spec) if kind == "tune_time" else cold_start(kind, spec)
    print("BENCH-RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
