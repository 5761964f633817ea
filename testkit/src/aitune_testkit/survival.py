"""What aitune survives: ``python -m aitune_testkit.survival`` prints it as a markdown table.

It runs every fault-injection backend of :mod:`aitune_testkit.faults`, every bad input of
docs/errors.md and a batch of mutated artifacts, each in this process, and reports the outcome:
survived means the process carried on and the user got an aitune error or a warning that says
what happened (never a crash, a hang or a foreign exception). Runs on CPU in about a minute.
A development tool of the test kit: it needs no pytest. Each scenario is a short function that
makes one row of the table.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import sys
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

Outcome = tuple[bool, str]


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- scenarios ------------------------------------------------------------------------------------


def _quick() -> Any:
    from aitune.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

    return ProfilingConfig(
        measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5), extend_s=0.0
    )


def _data() -> list[torch.Tensor]:
    return [torch.randn(2, 8), torch.randn(4, 8)]


def _with_fallback(backend: Any, manager: Any, inner: torch.nn.Module | None = None, **tune: Any) -> Outcome:
    """Tune ``backend`` next to a working toy: the faulty candidate fails, tuning goes on."""
    import aitune.torch as ait
    from aitune.testing.backends import ToyBackend, ToyConfig

    from .doubles import SlowModule

    model = ait.Module(
        inner or SlowModule(),
        "m",
        strategy=ait.MaxThroughputStrategy(backends=[backend, ToyBackend(ToyConfig())], profiling_config=_quick()),
    )
    report = ait.tune(model, _data(), manager=manager, **tune)
    bad = next(c for c in report.modules[0].graphs[0].candidates if c.backend == backend.name)
    with torch.no_grad():
        alive = model(torch.randn(3, 8)).shape == (3, 8)
    text = f"candidate failed at {bad.stage}: {bad.reason}" if bad.status == "failed" else f"candidate {bad.status}"
    return alive and report.modules[0].status == "tuned", text


def _expect(exc_type: type[BaseException], fn: Callable[[], Any]) -> Outcome:
    try:
        fn()
    except exc_type as exc:
        return True, f"{type(exc).__name__}: {exc}"
    return False, "no error"


def _infer_fails(manager: Any) -> Outcome:
    import aitune.torch as ait

    from .doubles import SlowModule
    from .faults import InferFailBackend

    model = ait.Module(
        SlowModule(), "m", strategy=ait.MaxThroughputStrategy(backends=[InferFailBackend()], profiling_config=_quick())
    )
    ait.tune(model, _data(), manager=manager)
    x = torch.randn(3, 8)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = torch.equal(model(x), model.module(x))
    return same and bool(caught), f"RuntimeWarning: {caught[0].message}" if caught else "no warning"


def _oom_profiling(manager: Any) -> Outcome:
    import logging

    import aitune.torch as ait
    from aitune.profiling import ProfilingConfig
    from aitune.testing.backends import ToyConfig

    from .doubles import SlowModule
    from .faults import OutOfMemoryBackend

    config = ProfilingConfig(
        batch_sizes=[2, 4, 16], measurement_stop_strategy=_quick().measurement_stop_strategy, extend_s=0.0
    )
    strategy = ait.MaxThroughputStrategy(backends=[OutOfMemoryBackend(ToyConfig(max_batch=4))], profiling_config=config)
    model = ait.Module(SlowModule(), "m", strategy=strategy)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("aitune").addHandler(handler)
    try:
        report = ait.tune(model, _data(), batch_sizes=[16], manager=manager)
    finally:
        logging.getLogger("aitune").removeHandler(handler)
    sizes = [p.batch_size for p in report.modules[0].graphs[0].candidates[0].profiles]
    message = next((r for r in records if "out of memory" in r), "no warning")
    return sizes == [2, 4], f"warning: {message}; kept the figures for batch {sizes}"


def _broken_plugin() -> Outcome:
    from aitune.plugins import AituneManager

    with tempfile.TemporaryDirectory() as site:
        (Path(site) / "aitune_broken_plugin.py").write_text(
            "raise ImportError('libfoo.so: cannot open shared object')\n"
        )
        info = Path(site) / "aitune_broken-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: aitune-broken\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text("[aitune]\naitune_broken_plugin = aitune_broken_plugin\n")
        sys.path.insert(0, site)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                AituneManager().load_entry_points()
        finally:
            sys.path.remove(site)
    message = next((str(w.message) for w in caught if "aitune_broken_plugin" in str(w.message)), "")
    return bool(message), f"RuntimeWarning: {message}"


def _model_error(inner: torch.nn.Module, data: list[Any], manager: Any) -> Outcome:
    import aitune.torch as ait
    from aitune.testing.backends import ToyBackend

    model = ait.Module(inner, "m", strategy=ait.OneBackendStrategy(ToyBackend(), profiling_config=_quick()))
    report = ait.tune(model, data, manager=manager)
    module = report.modules[0]
    return module.status == "failed" and model.state == "passthrough", f"module stays eager; report: {module.error}"


class _TakesACallback(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, callback: Any = None) -> torch.Tensor:
        return self.fc(x) if callback is None else callback(self.fc(x))


def _callable_argument(manager: Any) -> Outcome:
    import aitune.torch as ait
    from aitune.testing.backends import ToyBackend

    model = ait.Module(_TakesACallback(), "m", strategy=ait.OneBackendStrategy(ToyBackend(), profiling_config=_quick()))
    report = ait.tune(model, [((torch.randn(2, 8), torch.tanh), {})], manager=manager)
    graph = report.modules[0].graphs[0]
    y = model(torch.randn(2, 8), torch.tanh)
    ok = graph.decision == "torch_eager" and bool(graph.reason) and float(y.abs().max()) <= 1.0
    return ok, f"that graph stays eager; report: {graph.reason}"


def _grad_inputs(manager: Any) -> Outcome:
    import aitune.torch as ait
    from aitune.testing.backends import ToyBackend

    from .doubles import SlowModule

    model = ait.Module(SlowModule(), "m", strategy=ait.OneBackendStrategy(ToyBackend(), profiling_config=_quick()))
    ait.tune(model, [t.requires_grad_() for t in _data()], manager=manager)
    x = torch.randn(3, 8, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x).sum().backward()
    return x.grad is not None, f"RuntimeWarning: {caught[0].message}" if caught else "no warning"


def _meta_weights(manager: Any) -> Outcome:
    import aitune.torch as ait
    from aitune.errors import InputError

    from .doubles import SlowModule

    model = ait.Module(SlowModule().to("meta"), "m")
    return _expect(InputError, lambda: ait.tune(model, _data(), manager=manager))


def _tune_raises(data: list[Any], manager: Any) -> Outcome:
    import aitune.torch as ait
    from aitune.errors import InputError

    from .doubles import SlowModule

    return _expect(InputError, lambda: ait.tune(ait.Module(SlowModule(), "m"), data, manager=manager))


def _nan_data() -> list[torch.Tensor]:
    x = torch.randn(2, 8)
    x[0, 0] = float("nan")
    return [x]


def scenarios(manager: Any) -> list[tuple[str, str, Callable[[], Outcome]]]:
    """Each case, run with ``manager``'s plugins (the toy backends and the faults registered)."""
    from . import faults

    m = manager

    return [
        ("fault", "build segfaults (SIGSEGV) in the worker", lambda: _with_fallback(faults.SegfaultBackend(), m)),
        ("fault", "build aborts (SIGABRT) in the worker", lambda: _with_fallback(faults.AbortBackend(), m)),
        ("fault", "build calls os._exit(7) in the worker", lambda: _with_fallback(faults.ExitBackend(), m)),
        ("fault", "build raises in the worker", lambda: _with_fallback(faults.RaisingBackend(), m)),
        (
            "fault",
            "build hangs (time limit 10 s)",
            lambda: _with_env(_with_fallback, faults.HangBackend(), m, AITUNE_BUILD_TIMEOUT_S="10"),
        ),
        (
            "fault",
            "build eats memory (cap 2500 MB)",
            lambda: _with_env(_with_fallback, faults.MemoryHogBackend(), m, AITUNE_BUILD_MEMORY_MB="2500"),
        ),
        ("fault", "backend returns NaN", lambda: _with_fallback(_toy_nan(), m)),
        ("fault", "backend raises at inference after tuning", lambda: _infer_fails(m)),
        ("fault", "out of memory while profiling a large batch", lambda: _oom_profiling(m)),
        ("fault", "a plugin raises at import", _broken_plugin),
        ("input", "empty dataset", lambda: _tune_raises([], m)),
        (
            "input",
            "dataset items of mismatched structure",
            lambda: _tune_raises([torch.randn(2, 8), {"x": torch.randn(2, 8), "y": 1}], m),
        ),
        ("input", "inputs that require grad, called outside no_grad", lambda: _grad_inputs(m)),
        ("input", "weights not materialized (meta device)", lambda: _meta_weights(m)),
        ("input", "NaN in the inputs", lambda: _model_error(_slow(), _nan_data(), m)),
        ("input", "an argument no backend can take (a callable)", lambda: _callable_argument(m)),
    ]


def _slow() -> torch.nn.Module:
    from .doubles import SlowModule

    return SlowModule()


def _toy_nan() -> Any:
    from .doubles import NaNBackend

    return NaNBackend()


def _with_env(fn: Callable[..., Outcome], *args: Any, **env: str) -> Outcome:
    with _env(**env):
        return fn(*args)


# -- a fuzz batch ---------------------------------------------------------------------------------


def _valid_artifact(folder: Path, manager: Any) -> bytes:
    import aitune.torch as ait
    from aitune.testing.backends import ToyBackend

    from .doubles import SlowModule

    strategy = ait.OneBackendStrategy(ToyBackend(), profiling_config=_quick()).enable_performance_validation(False)
    model = ait.Module(SlowModule(delay_s=0.0), "m", strategy=strategy)
    ait.tune(model, _data(), manager=manager)
    return ait.save(model, folder / "valid.ait", manager=manager).read_bytes()


def _members(data: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def _pack(items: list[tuple[str, bytes]], resum: bool = False, deflate: bool = False) -> bytes:
    if resum:
        rest = [(n, b) for n, b in items if n != "SHA256SUMS"]
        sums = "".join(f"{hashlib.sha256(b).hexdigest()}  {n}\n" for n, b in sorted(rest)).encode()
        items = [*rest, ("SHA256SUMS", sums)]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED) as z:
        for name, body in items:
            z.writestr(name, body)
    return out.getvalue()


def _mutate(valid: bytes, kind: str, rng: random.Random) -> bytes:
    if kind == "flipped bytes":
        data = bytearray(valid)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= rng.randint(1, 255)
        return bytes(data)
    if kind == "truncated":
        return valid[: rng.randrange(len(valid))]
    items = _members(valid)
    if kind == "reordered, renamed or dropped members":
        rng.shuffle(items)
        i = rng.randrange(len(items))
        choice = rng.choice(["rename", "drop", "duplicate"])
        if choice == "rename":
            items[i] = (rng.choice(["../x", "/abs", "a\\b", "manifest.json", "x"]), items[i][1])
        elif choice == "drop":
            items.pop(i)
        else:
            items.append(items[i])
        return _pack(items, resum=rng.random() < 0.5)
    if kind == "hostile manifest (sums recomputed)":
        manifest = json.loads(dict(items)["manifest.json"])
        hostile: Any = rng.choice([None, -1, 2**63, 10**30, "../../x", [], {}, float("nan"), "x" * 10000, True])
        node = manifest
        for _ in range(rng.randint(1, 6)):
            keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
            if not keys:
                break
            key = rng.choice(keys)
            if rng.random() < 0.4 or not isinstance(node[key], (dict, list)):
                node[key] = hostile
                break
            node = node[key]
        text = json.dumps(manifest)
        if rng.random() < 0.2:
            text = "[" * 100000 + "]" * 100000
        return _pack([(n, text.encode() if n == "manifest.json" else b) for n, b in items], resum=True)
    # a zip bomb: weights that inflate to 256 MB, digests consistent
    weights = next(n for n, _ in items if n.endswith("weights.safetensors"))
    return _pack([(n, bytes(256 << 20) if n == weights else b) for n, b in items], resum=True, deflate=True)


FUZZ_KINDS = (
    "flipped bytes",
    "truncated",
    "reordered, renamed or dropped members",
    "hostile manifest (sums recomputed)",
    "zip bomb (256 MB inflated, sums recomputed)",
)


def fuzz_batch(
    folder: Path, per_kind: int, manager: Any, seed: int = 0
) -> list[tuple[str, int, dict[str, int], float]]:
    """Mutated artifacts by kind: how each load ended (loaded, an aitune error, anything else), with
    ``manager``'s plugins."""
    import aitune.torch as ait
    from aitune.artifact import verify
    from aitune.errors import AituneError

    from .doubles import SlowModule

    valid = _valid_artifact(folder, manager)
    rng = random.Random(seed)
    rows = []
    for kind in FUZZ_KINDS:
        counts = {"loaded": 0, "aitune error": 0, "other": 0}
        slowest = 0.0
        for _ in range(per_kind if "bomb" not in kind else 1):
            path = folder / "mutant.ait"
            path.write_bytes(_mutate(valid, kind, rng))
            start = time.perf_counter()
            try:
                ait.load(ait.Module(SlowModule(delay_s=0.0), "m"), path, manager=manager)
                verify(path, manager=manager)
                counts["loaded"] += 1
            except AituneError:
                counts["aitune error"] += 1
            except Exception:
                counts["other"] += 1
            slowest = max(slowest, time.perf_counter() - start)
        rows.append((kind, sum(counts.values()), counts, slowest))
    return rows


# -- the table ------------------------------------------------------------------------------------


def run(per_kind: int = 100) -> str:
    from aitune import plugins
    from aitune.testing import backends

    from . import doubles, faults

    lines = ["| Case | Kind | What the user gets | Survived |", "| --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory(prefix="aitune-survival-") as tmp, _env(AITUNE_CACHE_DIR=tmp):
        manager = plugins.AituneManager()
        manager.load_entry_points()
        manager.register(backends, name="aitune.testing.backends", distribution="aitune-core")
        manager.register(doubles, name="aitune_testkit.doubles", distribution="aitune-testkit")
        manager.register(faults, name="aitune_testkit.faults", distribution="aitune-testkit")
        for kind, name, scenario in scenarios(manager):
            try:
                ok, text = scenario()
            except Exception as exc:  # a scenario that escapes is a failure to survive, shown as such
                ok, text = False, f"escaped: {type(exc).__name__}: {exc}"
            lines.append(f"| {name} | {kind} | {_short(text)} | {'yes' if ok else '**no**'} |")
        for kind, total, counts, slowest in fuzz_batch(Path(tmp), per_kind, manager):
            text = f"{counts['aitune error']} ArtifactError, {counts['loaded']} still loaded, {counts['other']} other; slowest {slowest:.2f} s"
            lines.append(
                f"| {total} artifacts: {kind} | fuzz | {text} | {'yes' if not counts['other'] else '**no**'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aitune_testkit.survival", description=__doc__.splitlines()[0])
    parser.add_argument("--fuzz-examples", type=int, default=100, help="mutated artifacts per kind (default 100)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    table = run(args.fuzz_examples)
    print(table)
    return 0 if "**no**" not in table else 1


if __name__ == "__main__":
    sys.exit(main())
