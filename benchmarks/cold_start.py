"""Cold start phase by phase: a fresh process from its start to its first answer (issue 56).

``python -m benchmarks.cold_start [--case mlp] [--backends onnxruntime,torch_inductor_aot] [--repeats 5]``
tunes the case once per backend (each backend alone), saves the artifacts as a user would
(signed with the user's own key, so ``ait.load`` trusts them and skips its check against eager),
then starts fresh processes round-robin, after an unmeasured round: eager (build the model, load
its safetensors weights, first call) and ``ait.load(model, path)`` of each artifact (build the
model, load, first call). ``--baseline <checkout>`` times another checkout's ``ait.load`` of the
same artifacts in the same rounds.

The figure is the time from the process's start (the parent's clock before it starts the child;
``time.perf_counter`` is the machine's monotonic clock, the same in both) to the child's first
answer, in wall seconds and in CPU seconds (user + system, ``time.process_time``: what a busy
machine disturbs least); the exit after it is left out. The phases of a load: ``import
aitune.torch``; plugin discovery (the manager and whichever entry points load, also those
``ait.load`` loads when the artifact names their backend); the payloads' ``aitune_deserialize``
(the ONNX Runtime session or the AOTInductor package made: timed by a hook wrapper); reading the
artifact (the rest of ``ait.load``: digests, signature, manifest, weights, the plan, installing).
Figures are medians over the repeats, the min-max beside them. Nothing here is timed against a
bound: it prints tables and writes JSON.
"""

from __future__ import annotations

import time

T0, CPU0 = time.perf_counter(), time.process_time()  # before anything else the child imports

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PHASES = (
    "python",
    "torch + model code",
    "build",
    "weights",
    "import aitune",
    "plugins",
    "reading",
    "payload",
    "first answer",
)
"""In process order: ``python`` is the interpreter's start up to this module (site, runpy);
``weights`` is eager's ``load_state_dict`` of a safetensors file."""
FULL_GC = "of which full GC"
"""Seconds in full garbage collections, already inside the phases (see :class:`_FullCollections`)."""


@contextmanager
def _timed_discovery(spent: list[tuple[float, float]]) -> Iterator[None]:
    """Adds to ``spent`` the time (wall, CPU) the plugin manager spends making itself and loading entry points."""
    from aitune import plugins

    wrapped = {}
    for name in ("__init__", "find_entry_points", "load_entry_points", "_discover"):
        original = getattr(plugins.AituneManager, name, None)
        if original is None:
            continue

        def timed(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
            if getattr(self, "_bench_timing", False):  # nested: the outer call counts it
                return __original(self, *args, **kwargs)
            object.__setattr__(self, "_bench_timing", True)
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return __original(self, *args, **kwargs)
            finally:
                spent.append((time.perf_counter() - start, time.process_time() - cpu))
                object.__setattr__(self, "_bench_timing", False)

        wrapped[name] = original
        setattr(plugins.AituneManager, name, timed)
    try:
        yield
    finally:
        for name, original in wrapped.items():
            setattr(plugins.AituneManager, name, original)


class _DeserializeTimer:
    """A plugin wrapping ``aitune_deserialize``: the payload's own load (session, package)."""

    def __init__(self) -> None:
        self.spent = self.cpu = 0.0

    def register(self, manager: Any) -> None:
        from aitune.plugin import hookimpl

        timer = self

        class Plugin:
            @hookimpl(wrapper=True)
            def aitune_deserialize(self) -> Any:
                start, cpu = time.perf_counter(), time.process_time()
                try:
                    return (yield)
                finally:
                    timer.spent += time.perf_counter() - start
                    timer.cpu += time.process_time() - cpu

        manager.register(Plugin(), name="benchmarks.cold_start.timer", distribution="benchmarks")


class _FullCollections:
    """Seconds (wall, CPU) the garbage collector spends in full (generation 2) collections: a cost
    that lands inside whichever phase allocates the object that crosses CPython's threshold."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self._start = (0.0, 0.0)
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = (time.perf_counter(), time.process_time())
        else:
            self.wall += time.perf_counter() - self._start[0]
            self.cpu += time.process_time() - self._start[1]


def child(kind: str, spec: dict[str, Any]) -> dict[str, float]:
    """One cold start, measured from inside; returns seconds per phase (``python`` is the parent's to fill)."""
    collections = _FullCollections()
    import torch

    from .models import get

    case = get(spec["case"])
    out: dict[str, float] = {}
    cpu: dict[str, float] = {}
    mark, cpu_mark = T0, CPU0

    def lap(phase: str) -> None:
        nonlocal mark, cpu_mark
        now, cpu_now = time.perf_counter(), time.process_time()
        out[phase] = out.get(phase, 0.0) + now - mark
        cpu[phase] = cpu.get(phase, 0.0) + cpu_now - cpu_mark
        mark, cpu_mark = now, cpu_now

    lap("torch + model code")
    model = case.build("cpu")
    lap("build")
    if kind == "eager":
        from safetensors.torch import load_file

        model.load_state_dict(load_file(spec["weights"]))
        lap("weights")
    else:
        discovery: list[tuple[float, float]] = []
        with _timed_discovery(discovery):
            import aitune.torch as ait

            lap("import aitune")
            from aitune.plugins import get_manager

            timer = _DeserializeTimer()
            manager = get_manager()
            timer.register(manager)
            model = ait.Module(model, case.name)
            ait.load(model, spec["artifact"], manager=manager)
            lap("reading")
        out["plugins"], out["payload"] = sum(w for w, _ in discovery), timer.spent
        cpu["plugins"], cpu["payload"] = sum(c for _, c in discovery), timer.cpu
        for times in (out, cpu):  # ait.load less discovery and the payloads' own load
            times["reading"] -= times["plugins"] + times["payload"]
    with torch.no_grad():
        model(case.inputs(1, "cpu"))
    lap("first answer")
    out["answered_at"], cpu["answered_at"] = mark, cpu_mark
    out[FULL_GC], cpu[FULL_GC] = collections.wall, collections.cpu
    out["started_at"], cpu["python"] = T0, CPU0
    out["modules"] = float(len(sys.modules))
    out["imported"] = [m for m in HEAVY if m in sys.modules]  # type: ignore[assignment]
    out["cpu"] = cpu  # type: ignore[assignment]
    return out


HEAVY = ("onnx", "onnxscript", "onnxruntime", "torchao", "transformers", "torch._dynamo", "torch._inductor",
         "sympy", "ray", "kserve", "tensorrt", "torch_tensorrt", "cryptography", "safetensors")  # fmt: skip
"""Modules whose presence after the load the table names (what the load imported or did not)."""


def _run_child(kind: str, spec: dict[str, Any], env: dict[str, str]) -> tuple[float, dict[str, Any]]:
    """The child's wall time from outside, and its own figures, with its start (``python``) and its
    first answer (``answer``) counted from the moment before it was started."""
    cmd = [sys.executable, "-m", "benchmarks.cold_start", "--child", kind, json.dumps(spec)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    line = next((x for x in proc.stdout.splitlines() if x.startswith("COLD-START ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{kind} child failed (rc {proc.returncode}): {' | '.join(tail)}")
    inside = json.loads(line.removeprefix("COLD-START "))
    inside["python"] = inside.pop("started_at") - start
    inside["answer"] = inside.pop("answered_at") - start
    inside["cpu"]["answer"] = inside["cpu"].pop("answered_at")
    return wall, inside


def _artifacts(case_name: str, backends: list[str], tmp: Path) -> dict[str, Path]:
    """Tune the case with each backend alone and save it (signed with the user's own key, as ``ait.save`` does)."""
    from safetensors.torch import save_file

    import aitune.torch as ait

    from .models import get
    from .tuning import dataset, oracle_strategy, wrap

    case = get(case_name)
    base = case.build("cpu")
    save_file(
        {k: v.detach().contiguous().clone() for k, v in base.state_dict().items()}, str(tmp / "weights.safetensors")
    )
    out = {}
    for backend in backends:
        model = wrap(case, case.build("cpu"), oracle_strategy(backend, 1))
        ait.tune(model, dataset(case, [1], "cpu"), batch_sizes=[1])
        if not model.tuned_graphs or model.tuned_graphs[0][1].name != backend:
            raise SystemExit(f"{backend} did not tune the {case_name} case here; pick another backend")
        out[backend] = tmp / f"{case_name}-{backend}.ait"
        ait.save(model, out[backend])
    return out


def _sources(checkout: Path) -> str:
    """A PYTHONPATH that runs ``checkout``'s aitune (its members' ``src`` folders) with these benchmarks."""
    found = sorted(str(p) for p in checkout.glob("*/src") if p.parent.name.startswith(("aitune-", "testkit")))
    if not found:
        raise SystemExit(f"{checkout} holds no aitune-*/src folders (a checkout or `git archive` of aitune)")
    return os.pathsep.join([*found, str(ROOT)])


def measure(
    case: str, backends: list[str], repeats: int, tmp: Path, warmup: int = 1, baseline: Path | None = None
) -> dict[str, Any]:
    """``warmup`` unmeasured rounds first: bytecode written, the files in the page cache, as on a
    machine that started the service before. ``baseline``: another checkout whose ``ait.load`` of
    the same artifacts runs in the same rounds (labelled "baseline")."""
    artifacts = _artifacts(case, backends, tmp)
    contenders: dict[str, tuple[str, dict[str, Any], dict[str, str]]] = {
        "eager": ("eager", {"case": case, "weights": str(tmp / "weights.safetensors")}, {})
    }
    for backend, path in artifacts.items():
        contenders[f"ait.load ({backend})"] = ("aitune", {"case": case, "artifact": str(path)}, {})
        if baseline is not None:
            contenders[f"ait.load ({backend}), baseline"] = (
                "aitune",
                {"case": case, "artifact": str(path)},
                {"PYTHONPATH": _sources(baseline)},
            )
    names = list(contenders)
    runs: dict[str, list[tuple[float, dict[str, Any]]]] = {n: [] for n in names}
    before = os.getloadavg()
    for r in range(-warmup, repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            kind, spec, extra = contenders[name]
            env = {"AITUNE_CACHE_DIR": tempfile.mkdtemp(dir=tmp), "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(dir=tmp)}
            env.update(extra)
            wall, inside = _run_child(kind, spec, env)
            if r >= 0:
                runs[name].append((wall, inside))
        if r == -1:
            before = os.getloadavg()
    return {"case": case, "repeats": repeats, "load_average": before, "runs": runs}


def table(results: dict[str, Any], cpu: bool = False) -> str:
    """Medians per phase (wall seconds, or with ``cpu`` CPU seconds) and to the first answer, that
    against eager's, and the exit after it (wall, from outside)."""
    runs = results["runs"]

    def figures(inside: dict[str, Any]) -> dict[str, float]:
        return inside["cpu"] if cpu else inside

    eager = statistics.median(figures(i)["answer"] for _, i in runs["eager"])
    head = ["contender", *PHASES, FULL_GC, "to first answer (min-max)", "vs eager", "exit", "modules", "imported"]
    rows = []
    for name, done in runs.items():
        cells = [name]
        for p in (*PHASES, FULL_GC):
            seen = [figures(i)[p] for _, i in done if p in figures(i)]
            cells.append(f"{statistics.median(seen):.3f}" if seen else "")
        answers = [figures(i)["answer"] for _, i in done]
        middle = statistics.median(answers)
        cells += [f"**{middle:.3f}** ({min(answers):.3f}-{max(answers):.3f})", f"{middle / eager:.2f}x",
                  f"{statistics.median(w - i['answer'] for w, i in done):.3f}",
                  f"{int(statistics.median(i['modules'] for _, i in done))}",
                  ", ".join(done[-1][1].get("imported", [])) or "-"]  # fmt: skip
        rows.append(cells)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--child"]:
        print("COLD-START " + json.dumps(child(argv[1], json.loads(argv[2]))), flush=True)
        return
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cold_start", description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="mlp")
    parser.add_argument("--backends", default="onnxruntime,torch_inductor_aot")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    parser.add_argument(
        "--baseline", type=Path, default=None, help="another aitune checkout, its ait.load timed in the same rounds"
    )
    parser.add_argument("--out", type=Path, default=None, help="write every run's phases here as JSON")
    args = parser.parse_args(argv)
    from aitune.artifact import ownkey

    if ownkey.off_reason() is not None:  # the artifacts would be neither trusted nor spared the check
        raise SystemExit(f"the user's own signing key is off ({ownkey.off_reason()}); this benchmark loads as its user")
    if sys.dont_write_bytecode and not sys.pycache_prefix:
        print("warning: PYTHONDONTWRITEBYTECODE is set, so every child compiles aitune from source (an installed "
              "package has its bytecode): unset it or set PYTHONPYCACHEPREFIX", file=sys.stderr)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="aitune-cold-start-") as folder:
        os.environ.setdefault("AITUNE_CACHE_DIR", str(Path(folder) / "tune-cache"))
        results = measure(args.case, args.backends.split(","), args.repeats, Path(folder), args.warmup, args.baseline)
    results["load_average_after"] = os.getloadavg()
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    print("Wall seconds, median per phase\n")
    print(table(results))
    print("\nCPU seconds, user + system, median per phase\n")
    print(table(results, cpu=True))
    shown = ", ".join(f"{a:.2f}" for a in results["load_average"])
    after = ", ".join(f"{a:.2f}" for a in results["load_average_after"])
    print(f"\nload average (1, 5, 15 min) {shown} when timing began, {after} when it ended")


if __name__ == "__main__":
    main(sys.argv[1:])
