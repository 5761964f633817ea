#!/usr/bin/env python
"""The GPU check: one command on a fresh machine with an NVIDIA GPU, in the time given (``--budget``, 540 s).

    python scripts/gpu_check.py [--venv DIR] [--skip-install] [--skip-tests] [--skip-tune] [--budget S]

1. **Install** into a virtual environment of its own (``.gpu-venv``) that sees the machine's torch
   (``--system-site-packages``) and may never replace it: every pip call carries the constraint
   ``torch==<the installed version>``. Every member editable; the TensorRT member with the
   TensorRT wheel of torch's CUDA major; the Torch-TensorRT member with the extra that pins the
   torch-tensorrt release of this torch minor; ONNX Runtime as ``onnxruntime-gpu`` only (the CPU
   build is never installed beside it).
2. **Test**: every member's ``gpu``-marked tests, each member with its own time budget, Torch-TRT
   first; a member that runs out of time shows the test it was in.
3. **Compilers and headers**, checked before the tune: Triton (Inductor's and TorchAO's CUDA
   kernels) compiles its launcher with a C compiler against ``Python.h``, Inductor's backend needs
   a C++ compiler; the rows an image without them cannot run are named up front and print as
   "not installed here".
4. **Tune** a CNN and a transformer encoder layer with every GPU backend (TensorRT fp16 with CUDA
   graphs, Torch-TensorRT JIT and AOT, ONNX Runtime with the CUDA and the TensorRT provider,
   TorchAO, Inductor), one backend at a time, and save each result; then a **fresh process** loads
   every artifact, checks it against eager at the recorded shapes A, B, A again (CUDA graphs
   replayed after re-shaping) and at batch 1 (the ``mark_dynamic`` minimum), each within a bound,
   and one table is printed: backend x (build, precision, correct, speedup, load, A-B-A), each
   cell a measured value or the error. The rows are planned to fit the time left: a row is tuned
   only while its estimate (``ROW_COST_S``) and the loads of the rows saved before it fit, so when
   time is short the last rows (the CNN in bf16, then the encoder's) print "not run: out of time".

**Offline** (``--wheelhouse DIR``, for a GPU machine with no network whose system Python holds
torch): the wheels ``scripts/gpu_wheelhouse.sh`` collected on a networked machine are installed
with ``pip install --no-index --no-deps --target`` into a temporary folder put on ``PYTHONPATH``
(torch is never touched; no venv, no nox, no tests), then the tune and the fresh-process load run
with what the machine has: eager's baseline, Inductor JIT and AOT in fp32 and bf16, TorchAO
weight-only int8 (and fp8 on Hopper), ONNX Runtime where a GPU build is installed. A runtime the
machine lacks (TensorRT, Torch-TensorRT, onnxruntime-gpu, the TensorRT 10 library the ONNX Runtime
provider loads) is a row that says "not installed here", not a failure.

The script itself imports neither torch nor aitune: it runs every step in the environment's
Python, so nothing it installs can change under it. Each row ends ``ok``, ``not installed``,
``not run`` (the time given was the limit) or ``failed`` (:func:`status`). Exit status
(:func:`verdict`): 0 when the tests passed, no row failed and at least one row was verified; 1
otherwise (a row that crashed the tune or hung, a wrong output, a load error, a wrong output after
loading, a precision other than asked for, a silent fallback, a failed install, nothing verified);
2 without a CUDA GPU. ``scripts/README.md`` shows the table's layout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 540.0
"""The default of ``--budget``: seconds for the whole check (a lent GPU machine's call runs 600)."""
START = time.monotonic()
budget_s = BUDGET_S
"""The time this run was given (``--budget``)."""

TEST_BUDGETS = [  # member -> seconds; Torch-TRT first, so a slow install never starves it
    ("aitune-backend-torchtrt", 110.0),
    ("aitune-backend-tensorrt", 100.0),
    ("aitune-backend-onnxruntime", 45.0),
    ("aitune-backend-torchao", 45.0),
    ("aitune-backend-inductor", 30.0),
    ("aitune-core", 30.0),
    ("tests", 30.0),
]
TUNE_RESERVE_S = 150.0
"""Kept for the tune and the load when the tests start."""
TORCHTRT_TESTED = ((2, 8), (2, 14))
"""Torch minors with a ``torch2X`` extra in aitune-backend-torchtrt's pyproject."""


def left() -> float:
    return budget_s - (time.monotonic() - START)


def step(title: str) -> None:
    print(f"\n=== {title} ({left():.0f}s left) ===", flush=True)


def run(cmd: list[str], timeout: float, log: Path | None = None) -> int:
    """Run ``cmd`` in the repository; 124 on timeout (with the log's tail, which names where it was)."""
    print("$", " ".join(cmd), flush=True)
    out = open(log, "w") if log else None  # noqa: SIM115 - closed below
    try:
        return subprocess.run(
            cmd, cwd=ROOT, timeout=max(timeout, 1), stdout=out, stderr=subprocess.STDOUT if out else None
        ).returncode
    except subprocess.TimeoutExpired:
        print(f"TIMED OUT after {timeout:.0f}s", flush=True)
        return 124
    finally:
        if out:
            out.close()


def tail(log: Path, lines: int = 25) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.is_file() else ""


# -- facts about the machine, asked of a Python that has torch --------------------------------


def machine_facts(python: str) -> dict[str, Any] | None:
    code = (
        "import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
        "'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name() if c else None, "
        "'cc': list(torch.cuda.get_device_capability()) if c else None, 'gpus': torch.cuda.device_count()}))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def torch_minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# -- 1. install --------------------------------------------------------------------------------


def install_wheelhouse(wheelhouse: Path) -> Path:
    """The wheels of ``wheelhouse`` into a fresh folder put on ``PYTHONPATH``: no index, no deps, no venv,
    so the machine's torch is never touched; returns the folder."""
    step("install the wheelhouse (offline)")
    wheels = sorted(wheelhouse.glob("*.whl"))
    if not wheels:
        raise SystemExit(
            f"no wheels in {wheelhouse}: run scripts/gpu_wheelhouse.sh {wheelhouse} on a networked machine"
        )
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB", flush=True)
    wheels, kept = wheels_to_install(wheels, lambda module: importlib.util.find_spec(module) is not None)
    for name in kept:
        print(f"{name}: the image's own (its wheel is left out)", flush=True)
    target = Path(tempfile.mkdtemp(prefix="aitune-gpu-wheelhouse-"))
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", "--target", str(target)]
    if run([*cmd, *(str(w) for w in wheels)], max(left(), 60)) != 0:
        raise SystemExit(f"the wheelhouse {wheelhouse} did not install (pip's message is above)")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(target))
    where = "import aitune.torch, aitune; print('aitune', aitune.__version__, 'from', aitune.__file__)"
    if run([sys.executable, "-c", where], 120) != 0:
        raise SystemExit("aitune does not import from the wheelhouse (the error is above)")
    return target


IMAGE_OPTIONAL = {"numpy": "numpy", "onnx": "onnx", "protobuf": "google.protobuf"}
"""Distributions the wheelhouse carries for an image that lacks them (distribution -> module): put
on ``PYTHONPATH`` beside an image's own numpy they would shadow the one torch was built with."""


def wheel_distribution(wheel: Path) -> str:
    """``onnx_ir-1.1.0-py3-none-any.whl`` -> ``onnx-ir`` (a wheel's file name starts with its normalised name)."""
    return wheel.name.split("-")[0].lower().replace("_", "-")


def wheels_to_install(wheels: list[Path], present: Callable[[str], bool]) -> tuple[list[Path], list[str]]:
    """The wheels to install, and the optional distributions left out because the image has them."""
    install, kept = [], []
    for wheel in wheels:
        name = wheel_distribution(wheel)
        if name in IMAGE_OPTIONAL and present(IMAGE_OPTIONAL[name]):
            kept.append(name)
        else:
            install.append(wheel)
    return install, kept


def venv_python(venv: Path) -> str:
    return str(venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python"))


def tensorrt_runtime(cuda_major: int) -> list[str]:
    """The TensorRT member's ``runtime`` extra and its ``cu<major>`` extra: the TensorRT wheel of torch's CUDA major."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: pip carries a TOML reader
        from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

    meta = tomllib.loads((ROOT / "aitune-backend-tensorrt" / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    return [*extras[f"cu{cuda_major}"], *extras["runtime"]]


def install(venv: Path, facts: dict[str, Any]) -> list[str]:
    """Install into ``venv``; the notes (what was left out and why) go under the table."""
    step("install")
    notes: list[str] = []
    if not Path(venv_python(venv)).exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={facts['torch']}\n")  # pip fails rather than replace the machine's torch
    pip = [venv_python(venv), "-m", "pip", "install", "--disable-pip-version-check", "-q", "-c", str(constraints)]
    cuda_major = int(str(facts["cuda"]).split(".")[0])

    base = ["-e", "./aitune-core", "-e", "./aitune-backend-inductor", "-e", "./aitune-backend-torchao"]
    base += ["-e", "./aitune-backend-onnxruntime", "onnxruntime-gpu>=1.18", "pytest>=8", "hypothesis>=6.100"]
    if run([*pip, *base], timeout=min(150, left() - 300)) != 0:
        notes.append("installing core, Inductor, TorchAO and ONNX Runtime failed (see the log above)")

    trt = ["-e", "./aitune-backend-tensorrt"] if cuda_major == 12 else []
    if cuda_major != 12:  # the member's own dependency is the CUDA 12 wheel
        run([*pip, "--no-deps", "-e", "./aitune-backend-tensorrt"], timeout=60)
        trt = tensorrt_runtime(cuda_major)
    minor = torch_minor(facts["torch"])
    torchtrt: list[str] = []
    if TORCHTRT_TESTED[0] <= minor <= TORCHTRT_TESTED[1]:
        torchtrt = ["-e", f"./aitune-backend-torchtrt[torch{minor[0]}{minor[1]}]"]
    else:
        run([*pip, "--no-deps", "-e", "./aitune-backend-torchtrt"], timeout=60)
        notes.append(f"Torch-TensorRT {NOT_INSTALLED}: torch {facts['torch']} has no tested torch-tensorrt release")
    # TensorRT and Torch-TensorRT in one resolve, so they agree on one TensorRT (one download)
    if run([*pip, *trt, *torchtrt], timeout=min(240, left() - 240)) != 0 and torchtrt:
        notes.append("TensorRT and Torch-TensorRT together failed to install; trying each alone")
        for group, name in ((trt, "TensorRT"), (torchtrt, "Torch-TensorRT")):
            if run([*pip, *group], timeout=min(150, left() - 240)) != 0:
                notes.append(f"{name} failed to install (see the log above)")
    both = _distributions(venv_python(venv), ("onnxruntime", "onnxruntime-gpu"))
    if len(both) > 1:
        notes.append(f"both ONNX Runtime builds are visible ({both}): remove the CPU one from the base environment")
    print("onnxruntime providers:", _ort_providers(venv_python(venv)), flush=True)
    return notes


def _distributions(python: str, names: tuple[str, ...]) -> list[str]:
    code = (
        "import importlib.metadata as m, sys\nfor n in sys.argv[1:]:\n    try: print(n, m.version(n))\n"
        "    except m.PackageNotFoundError: pass"
    )
    out = subprocess.run([python, "-c", code, *names], capture_output=True, text=True)
    return out.stdout.split("\n")[:-1] if out.returncode == 0 else []


def _ort_providers(python: str) -> list[str]:
    code = "import onnxruntime as o; print(','.join(o.get_available_providers()))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return out.stdout.strip().split(",") if out.returncode == 0 else []


# -- 2. the gpu-marked tests, a budget per member ------------------------------------------------


def tests(python: str, logs: Path) -> dict[str, str]:
    step("gpu-marked tests")
    results = {}
    for member, budget in TEST_BUDGETS:
        if not (ROOT / member).is_dir():
            continue
        path = f"{member}/tests" if member.startswith("aitune-") else member
        timeout = min(budget, left() - TUNE_RESERVE_S)
        if timeout < 10:
            results[member] = "not run: out of time"
            continue
        log = logs / f"tests-{member}.log"
        cmd = [python, "-m", "pytest", "-m", "gpu", "-v", "-rs", "-p", "no:cacheprovider", "-p", "no:randomly", path]
        code = run(cmd, timeout, log)
        last = tail(log, 1)
        if code == 124:
            results[member] = f"TIMED OUT after {timeout:.0f}s; was running: {tail(log, 1)}"
            print(tail(log), flush=True)
        elif code in (0, 5):  # 5: no gpu-marked test collected
            results[member] = last or "passed"
        else:
            results[member] = f"FAILED ({code}): {last}"
            print(tail(log, 60), flush=True)
        print(f"{member}: {results[member]}", flush=True)
    return results


# -- what compiles on this image: checked up front, the rows it removes said before the tune ------

TRITON_ROWS = ("inductor aot", "torchao int8wo", "torchao fp8wo", "torchao int8dq", "inductor", "inductor cudagraphs")
"""Rows that run Triton kernels (Inductor's, and TorchAO's compiled ones): on its first CUDA kernel
Triton compiles its ``cuda_utils`` and launcher C sources with ``$CC``, else ``gcc``, else ``clang``,
against ``Python.h`` from ``sysconfig``'s include folder (``triton/runtime/build.py``)."""
CXX_ROWS = ("inductor aot", "inductor", "inductor cudagraphs")
"""Rows aitune's Inductor backend refuses without a C++ compiler (``$CXX``, else ``g++``): Inductor
compiles generated C++ (AOTInductor's wrapper, CPU kernels)."""

INCLUDE_CODE = (
    "import sysconfig; s = sysconfig.get_default_scheme(); "
    "print(sysconfig.get_paths(scheme='posix_prefix' if s == 'posix_local' else s)['include'])"
)
"""The include folder Triton passes for ``Python.h`` (a Debian ``posix_local`` scheme read as ``posix_prefix``)."""


def python_include(python: str) -> str:
    """Where ``python`` (the one that tunes) keeps ``Python.h``, as Triton looks for it."""
    out = subprocess.run([python, "-c", INCLUDE_CODE], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def toolchain(include_dir: str, env: dict[str, str]) -> dict[str, str | None]:
    """The C compiler Triton would use, the C++ compiler Inductor would use (paths, or None when
    absent) and ``Python.h`` (its path, or None), looked up on ``env``'s ``PATH``."""
    path = env.get("PATH", "")

    def find(name: str) -> str | None:
        return shutil.which(name, path=path)

    cc = find(env["CC"]) if env.get("CC") else find("gcc") or find("clang")
    header = Path(include_dir) / "Python.h" if include_dir else None
    return {
        "cc": cc,
        "cxx": find(env.get("CXX") or "g++"),
        "python_h": str(header) if header is not None and header.is_file() else None,
        "include": include_dir,
        "cc_wanted": env.get("CC") or "gcc or clang",
        "cxx_wanted": env.get("CXX") or "g++",
    }


def removed_rows(found: dict[str, str | None]) -> dict[str, str]:
    """Backend rows this toolchain cannot run, each with why (they print as "not installed here")."""
    removed: dict[str, str] = {}
    if found["cxx"] is None:
        why = (
            f"no C++ compiler ({found['cxx_wanted']} is not on PATH): Inductor compiles generated C++ "
            "and aitune's Inductor backend refuses to run without one"
        )
        removed.update(dict.fromkeys(CXX_ROWS, why))
    lacking = []
    if found["cc"] is None:
        lacking.append(f"no C compiler ({found['cc_wanted']} on PATH, or $CC)")
    if found["python_h"] is None:
        lacking.append(f"no Python headers ({found['include'] or '?'}/Python.h: install python3-dev)")
    if lacking:
        why = "; ".join(lacking) + ": Triton compiles its launcher with them on its first CUDA kernel"
        for row in TRITON_ROWS:
            removed[row] = f"{removed[row]}; {why}" if row in removed else why
    return removed


def check_toolchain(python: str) -> dict[str, str]:
    """Print what compiles here and which rows that removes; the removed rows, with why."""
    step("compilers and headers")
    found = toolchain(python_include(python), dict(os.environ))
    print(
        f"C compiler: {found['cc'] or 'none (' + str(found['cc_wanted']) + ')'}; "
        f"C++ compiler: {found['cxx'] or 'none (' + str(found['cxx_wanted']) + ')'}; "
        f"Python headers: {found['python_h'] or 'none in ' + (found['include'] or '?')}",
        flush=True,
    )
    removed = removed_rows(found)
    by_reason: dict[str, list[str]] = {}
    for row, why in removed.items():
        by_reason.setdefault(why, []).append(row)
    for why, rows in by_reason.items():
        print(f"removes the rows {', '.join(rows)}: {why}", flush=True)
    if not removed:
        print("removes no row", flush=True)
    return removed


# -- 3. tune (in the environment's Python), then load in a fresh one ----------------------------


def models() -> dict[str, tuple[Any, list[Any]]]:
    """Seeded models (a CNN in fp32 and bf16, an encoder layer) and their batches; batch 1 is in the
    data, so every range starts at 1."""
    import copy

    import torch

    torch.manual_seed(0)
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
    )  # fmt: skip
    layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    g = torch.Generator().manual_seed(1)
    cnn_data = [torch.randn(b, 3, 64, 64, generator=g).cuda() for b in (1, 16, 16, 32)]
    return {
        "cnn": (cnn.eval().cuda(), cnn_data),
        "cnn bf16": (copy.deepcopy(cnn).eval().cuda().bfloat16(), [x.bfloat16() for x in cnn_data]),
        "encoder": (
            layer.eval().cuda(),
            [torch.randn(b, s, 256, generator=g).cuda() for b, s in ((1, 64), (8, 128), (8, 128), (16, 96))],
        ),
    }


NOT_INSTALLED = "not installed here"
"""A row whose runtime, library or compiler the image lacks: it says what is missing and does not fail."""
NOT_RUN = "not run"
"""A row the time given did not reach (``--budget``): it says so and does not fail."""
MISSING = "missing"
"""A planned row the tune never wrote because it crashed: that fails."""
MODEL_BACKENDS = {"cnn bf16": ("inductor aot", "inductor", "inductor cudagraphs")}
"""Models tuned with some backends only (the rest: all). bf16 is Inductor's to show; the others
lower precision their own way, and the time goes to the fp32 models' rows."""
MODELS = ("cnn", "encoder", "cnn bf16")
"""The models of :func:`models`, in the order they are tuned: when time runs short the last rows
are the ones not run."""
BACKEND_LABELS = (
    "inductor aot", "torchao int8wo", "torchao fp8wo", "tensorrt fp16+graphs", "torch_tensorrt_jit",
    "torch_tensorrt_aot", "ort cuda", "ort tensorrt", "torchao int8dq", "inductor", "inductor cudagraphs",
)  # fmt: skip
"""The rows of :func:`backends`, in order; ``torchao fp8wo`` on Hopper and later only."""
HOPPER_ONLY = ("torchao fp8wo",)


def planned_rows(capability: list[int] | None) -> list[tuple[str, str]]:
    """(model, backend) of every row the check must print for a GPU of this compute capability."""
    hopper = capability is not None and tuple(capability) >= (9, 0)
    labels = [label for label in BACKEND_LABELS if hopper or label not in HOPPER_ONLY]
    return [(m, label) for m in MODELS for label in labels if label in MODEL_BACKENDS.get(m, (label,))]


def missing_rows(
    rows: list[dict[str, Any]], planned: list[tuple[str, str]], out_of_time: bool = False
) -> list[dict[str, Any]]:
    """A row for each planned pair the tune never wrote: "not run" when the tune was stopped for
    time (``out_of_time``), "missing" (a failure) when it crashed first."""
    have = {(r.get("model"), r.get("backend")) for r in rows}
    build = f"{NOT_RUN}: out of time" if out_of_time else f"{MISSING}: the tune ended before this row"
    return [{"model": m, "backend": b, "build": build} for m, b in planned if (m, b) not in have]


ROW_COST_S = {
    "inductor aot": (100.0, 5.0),
    "torchao int8wo": (45.0, 25.0),
    "torchao fp8wo": (45.0, 25.0),
    "tensorrt fp16+graphs": (80.0, 5.0),
    "torch_tensorrt_jit": (70.0, 40.0),
    "torch_tensorrt_aot": (80.0, 10.0),
    "ort cuda": (25.0, 5.0),
    "ort tensorrt": (80.0, 15.0),
    "torchao int8dq": (45.0, 25.0),
    "inductor": (40.0, 20.0),
    "inductor cudagraphs": (45.0, 20.0),
}
"""Seconds one row is expected to take to tune (export, build, validation, diagnostic profiling) and
to load in the fresh process (JIT rows compile again there), per backend. Estimates, not
measurements: no GPU run has timed them yet; replace them with a run's own figures."""
FINISH_S = 10.0
"""Kept at the end of the budget for the table."""
LOAD_FLOOR_S = 30.0
"""Kept after the tune for the fresh process (start, imports and loads), at least: the parent stops a
tune that overruns its plan this long before the end."""
HANG_S = 300.0
"""A row still building this long when the tune's time ran out is reported as hung (a failure),
not as cut off by the time limit."""


def fits(label: str, left_s: float, pending_load_s: float) -> bool:
    """Whether a row of ``label`` can still be tuned in ``left_s`` seconds and leave time for the loads
    of the rows saved so far (``pending_load_s``) and its own, at least :data:`LOAD_FLOOR_S`."""
    tune_s, load_s = ROW_COST_S[label]
    return tune_s + max(load_s + pending_load_s, LOAD_FLOOR_S) <= left_s


def plan(order: list[tuple[str, str]], skip: dict[str, str], seconds: float) -> list[tuple[str, str, str]]:
    """Each row in ``order`` with what the tune expects to do with it in ``seconds``: ``run``, the
    reason it is skipped (``skip``: not installed, cannot be made), or "not run" when by the
    estimates (:data:`ROW_COST_S`) it no longer fits (:func:`fits`); later, cheaper rows may."""
    out, tuned_s, pending_load_s = [], 0.0, 0.0
    for model, label in order:
        if label in skip:
            out.append((model, label, skip[label]))
        elif fits(label, seconds - tuned_s, pending_load_s):
            tuned_s += ROW_COST_S[label][0]
            pending_load_s += ROW_COST_S[label][1]
            out.append((model, label, "run"))
        else:
            out.append((model, label, out_of_time(label, seconds - tuned_s - pending_load_s)))
    return out


def out_of_time(label: str, left_s: float) -> str:
    return f"{NOT_RUN}: out of time (about {sum(ROW_COST_S[label]):.0f}s to tune and load, {max(left_s, 0):.0f}s left)"


def cut_off(started: dict[str, Any], now: float) -> dict[str, Any]:
    """The row the tune was building when its time ran out: "not run" (the time was the limit), or
    a failure when it had been building for :data:`HANG_S` or longer."""
    seconds = now - float(started["started"])
    build = (
        f"TIMED OUT: still building after {seconds:.0f}s"
        if seconds >= HANG_S
        else f"{NOT_RUN}: out of time, cut off {seconds:.0f}s into its build"
    )
    return {"model": started["model"], "backend": started["backend"], "build": build}


LOWERED = {"tensorrt fp16+graphs": "fp16", "torchao int8wo": "int8", "torchao fp8wo": "fp8", "torchao int8dq": "int8"}
"""Rows whose backend is asked to compute below the model's dtype, and in what."""

PRECISION_FLOOR = {"fp16": 2e-5, "bf16": 2e-4, "int8": 1e-4, "fp8": 1e-4}
"""Relative error (max |y - y_eager| / max |y_eager|) below which these seeded models cannot have
been computed in that precision: fp16 alone rounds each value by up to 4.9e-4 of itself, and a
model as deep as these accumulates more. A lowered row under its floor computed in higher precision."""

ABA_FLOOR = 1e-3
"""The least bound of a fresh-process load check: an fp32 engine matches eager far closer, and a
graph replayed with another shape's setup is off by the output's own scale."""


def backends() -> list[tuple[str, Any]]:
    """Each GPU backend as the check builds it; a backend that cannot be made here is its error."""
    import torch

    from aitune.torch import backend as b

    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    wanted = [
        ("inductor aot", lambda: b.TorchInductorAotBackend()),
        ("torchao int8wo", lambda: b.TorchAOBackend(b.TorchAOBackendConfig(quantization="int8wo"))),
        *([("torchao fp8wo", lambda: b.TorchAOBackend(b.TorchAOBackendConfig(quantization="fp8wo")))] if hopper else []),
        ("tensorrt fp16+graphs", lambda: b.TensorRTBackend(b.TensorRTBackendConfig(
            quantization_config=b.ONNXAutoCastConfig(low_precision_type="fp16"), use_cuda_graphs=True))),
        ("torch_tensorrt_jit", lambda: b.TorchTensorRTJitBackend()),
        ("torch_tensorrt_aot", lambda: b.TorchTensorRTAotBackend()),
        ("ort cuda", lambda: b.ONNXRuntimeBackend(b.ONNXRuntimeBackendConfig(execution_provider="cuda"))),
        ("ort tensorrt", lambda: b.ONNXRuntimeBackend(b.ONNXRuntimeBackendConfig(execution_provider="tensorrt"))),
        ("torchao int8dq", lambda: b.TorchAOBackend()),
        ("inductor", lambda: b.TorchInductorJitBackend()),
        ("inductor cudagraphs", lambda: b.TorchInductorJitBackend(b.TorchInductorJitBackendConfig(mode="reduce-overhead"))),
    ]  # fmt: skip
    out: list[tuple[str, Any]] = []
    for label, make in wanted:
        try:
            out.append((label, make()))
        except ModuleNotFoundError as exc:  # a first-party backend whose distribution or runtime is absent
            out.append((label, RuntimeError(f"{NOT_INSTALLED}: {exc}")))
        except Exception as exc:
            out.append((label, exc))
    return out


def precision_cell(label: str, model_dtype: str, rel_error: float, build_info: dict[str, Any]) -> str:
    """What the row computed in, and the evidence; "MISMATCH: ..." when it cannot be what was asked for."""
    wanted = LOWERED.get(label, model_dtype)
    layers = build_info.get("layer_precisions")
    if isinstance(layers, dict) and layers:  # TensorRT's own inspector, checked by the build already
        return f"{wanted}: layers {', '.join(f'{k} {v}' for k, v in layers.items())}"
    floor = PRECISION_FLOOR.get(wanted) if wanted != model_dtype else None
    if floor is not None and rel_error < floor:
        return f"MISMATCH: asked {wanted}, error {rel_error:.1e} is under {wanted}'s floor {floor:.0e}"
    return f"{wanted}: error {rel_error:.1e}" if floor is not None else wanted


def fallback(label: str, build_info: dict[str, Any]) -> str | None:
    """Why a built row is not the backend it is named for (it ran elsewhere), or None."""
    if label.startswith("torch_tensorrt") and build_info.get("tensorrt_subgraphs") == 0:
        return "silent fallback: no TensorRT engine in the compiled module"
    providers = build_info.get("session_providers")
    if label.startswith("ort ") and providers:
        asked = {"ort cuda": "CUDAExecutionProvider", "ort tensorrt": "TensorrtExecutionProvider"}[label]
        if providers[0] != asked:
            return f"silent fallback: the session runs on {providers[0]}, not {asked}"
    return None


def _unavailable() -> dict[str, str]:
    """Backends whose runtime this machine lacks, with why (a row says so instead of failing)."""
    import torch

    from aitune.plugins import get_manager

    registry = get_manager().registry
    device = torch.device("cuda")
    return {n: r for n in registry.names() if (r := registry.unavailable(n, device))}


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"


def tune_worker(workdir: Path, deadline: float) -> None:
    """Tune every planned row in order, one JSON row per pair in ``rows.jsonl`` as soon as it is known.

    ``removed.json`` (written by the parent) names the rows the toolchain cannot run. Before each
    row, ``started.jsonl`` records it, so a tune stopped for time shows which row it was in. A row
    is tuned only if its estimate, and the loads of the rows saved before it, fit before ``deadline``.
    """
    import copy

    import torch

    import aitune.torch as ait

    rows = workdir / "rows.jsonl"
    removed_file = workdir / "removed.json"
    removed = json.loads(removed_file.read_text()) if removed_file.is_file() else {}
    missing = _unavailable()
    built = models()
    made = backends()
    skip: dict[str, str] = {}
    for label, backend in made:
        if label in removed:
            skip[label] = f"{NOT_INSTALLED}: {removed[label]}"
        elif isinstance(backend, Exception):
            text = str(backend)
            skip[label] = text[:200] if text.startswith(NOT_INSTALLED) else f"cannot be made: {_err(backend)}"
        elif backend.name in missing:
            skip[label] = f"{NOT_INSTALLED}: {missing[backend.name]}"
    order = planned_rows(list(torch.cuda.get_device_capability()))
    print(f"plan for {deadline - time.time():.0f}s (estimates per row: ROW_COST_S):", flush=True)
    for model_name, label, what in plan(order, skip, deadline - time.time()):
        print(f"  {model_name} / {label}: {what}", flush=True)
    templates = dict(made)
    pending_load_s = 0.0
    for model_name, label in order:
        model, data = built[model_name]
        row: dict[str, Any] = {"model": model_name, "backend": label}
        left_s = deadline - time.time()
        if label in skip:
            row["build"] = skip[label]
        elif not fits(label, left_s, pending_load_s):
            row["build"] = out_of_time(label, left_s - pending_load_s)
        else:
            print(f"-- {model_name} / {label}", flush=True)
            with (workdir / "started.jsonl").open("a") as f:
                f.write(json.dumps({"model": model_name, "backend": label, "started": time.time()}) + "\n")
            try:
                artifact = workdir / f"{model_name}-{label.replace(' ', '-').replace('+', '-')}.ait"
                row.update(_tune_one(ait, copy.deepcopy(model), data, templates[label], artifact, label))
            except Exception as exc:
                traceback.print_exc()
                row["build"] = _err(exc)
            if "artifact" in row:
                pending_load_s += ROW_COST_S[label][1]
        with rows.open("a") as f:
            f.write(json.dumps(row) + "\n")
        torch.cuda.empty_cache()


def _tune_one(ait: Any, model: Any, data: list[Any], backend: Any, artifact: Path, label: str) -> dict[str, Any]:
    strategy = ait.MaxThroughputStrategy(
        backends=[backend], performance_validation=ait.PerformanceValidationMode.DIAGNOSTIC
    )
    wrapped = ait.Module(model, "m", strategy=strategy)
    report = ait.tune(wrapped, data)
    module = report.modules[0]
    found = [c for g in module.graphs for c in g.candidates if c.backend == backend.name]
    if not found:
        return {"build": f"no candidate: {module.error or module.summary}"}
    c = found[0]
    if c.stage == "availability":  # the backend's own probe: a library or provider this image lacks
        return {"build": f"{NOT_INSTALLED}: {' '.join(str(c.reason).split())[:200]}"}
    if c.status == "failed" or c.build_time_s is None:
        return {"build": f"{c.stage or 'failed'}: {' '.join(str(c.reason).split())[:160]}"}
    row: dict[str, Any] = {"build": fallback(label, c.build_info) or f"{c.build_time_s:.1f}s"}
    v = c.validation
    rel = v.max_rel_error if v else 0.0
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(
        str(data[0].dtype).removeprefix("torch."), "?"
    )
    row["precision"] = precision_cell(label, dtype, rel, c.build_info)
    row["correct"] = (
        f"ok, rel err {rel:.1e}" if v and v.passed else f"NO: {v.reason if v else c.reason}; rel err {rel:.1e}"
    )
    row["speedup"] = c.speedup_text() if c.speedup is not None else f"not measured: {c.reason or c.status}"
    row["bound"] = max(4 * rel, ABA_FLOOR)  # the fresh-process load checks hold to this
    if c.status in ("selected", "rejected") and v and v.passed:
        ait.save(wrapped, artifact)
        row["artifact"] = str(artifact)
    return row


def load_worker(workdir: Path, deadline: float) -> None:
    """In a fresh process: load every saved artifact, time it, check A-B-A shapes and batch 1 against
    eager; a row whose load estimate no longer fits before ``deadline`` is not run."""
    import copy

    import torch

    import aitune.torch as ait

    out = workdir / "loads.jsonl"
    rows = [json.loads(line) for line in (workdir / "rows.jsonl").read_text().splitlines()]
    built = models()
    for row in rows:
        if "artifact" not in row:
            continue
        model, data = built[row["model"]]
        result = {"model": row["model"], "backend": row["backend"]}
        if time.time() + ROW_COST_S[row["backend"]][1] > deadline:
            result["load"] = f"{NOT_RUN}: out of time"
            with out.open("a") as f:
                f.write(json.dumps(result) + "\n")
            continue
        try:
            fresh = ait.Module(copy.deepcopy(model), "m")
            torch.cuda.synchronize()
            start = time.perf_counter()
            ait.load(fresh, row["artifact"], trust_native_code=True)  # built by this check a moment ago
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            a, b = data[1], data[3]  # two recorded shapes
            one = data[0][:1]
            bound = float(row["bound"])
            errors = []
            with torch.no_grad():
                # A again with other data (the batch reversed): a graph replayed stale, or outputs kept
                # from the first A, show here
                for name, x in (("A", a), ("B", b), ("A", a.flip(0)), ("b=1", one)):
                    got, want = fresh(x).float(), model(x).float()
                    errors.append((name, float((got - want).abs().max()) / max(float(want.abs().max()), 1e-12)))
            ok = all(e <= bound for _, e in errors)
            cells = ", ".join(f"{n} {e:.0e}" for n, e in errors)
            result["load"] = f"{seconds:.2f}s"
            result["A-B-A"] = f"ok: {cells} <= {bound:.0e}" if ok else f"NO: {cells}, bound {bound:.0e}"
        except Exception as exc:
            traceback.print_exc()
            result["load"] = _err(exc)
        with out.open("a") as f:
            f.write(json.dumps(result) + "\n")


def tune_and_load(python: str, workdir: Path, removed: dict[str, str]) -> tuple[list[dict[str, Any]], bool]:
    """The rows the tune and the fresh-process load wrote, and whether the tune was stopped for time."""
    step("tune")
    (workdir / "removed.json").write_text(json.dumps(removed))
    script = str(Path(__file__).resolve())
    end = time.time() + left() - FINISH_S  # the worker plans its rows, their loads included, to end by then
    tune_s = max(left() - LOAD_FLOOR_S - FINISH_S, 30)
    code = run([python, script, "--tune-worker", str(workdir), "--deadline", str(end)], tune_s)
    rows = _jsonl(workdir / "rows.jsonl")
    if code == 124:  # the row it was building when stopped
        done = {(r["model"], r["backend"]) for r in rows}
        unfinished = [s for s in _jsonl(workdir / "started.jsonl") if (s["model"], s["backend"]) not in done]
        rows += [cut_off(s, time.time()) for s in unfinished[-1:]]
    elif code != 0:
        rows.append({"model": "-", "backend": "-", "build": f"the tune process failed ({code}), see above"})
    step("load in a fresh process")
    loaded_code = 0
    if any("artifact" in r for r in rows):
        load_cmd = [python, script, "--load-worker", str(workdir), "--deadline", str(time.time() + left() - 5)]
        loaded_code = run(load_cmd, max(left() - 2, 20))
        if loaded_code == 124:
            print("loading ran out of time: the rows without a load cell were not loaded", flush=True)
    loads = {(r["model"], r["backend"]): r for r in _jsonl(workdir / "loads.jsonl")}
    for r in rows:
        loaded = loads.get((r["model"], r["backend"]), {})
        unloaded = f"{NOT_RUN}: out of time" if loaded_code == 124 else "not loaded (see above)"
        r["load"] = loaded.get("load") or (unloaded if "artifact" in r else "-")
        r["A-B-A"] = loaded.get("A-B-A", "-")
    return rows, code == 124


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def table(rows: list[dict[str, Any]]) -> str:
    cols = ("model", "backend", "build", "precision", "correct", "speedup", "load", "A-B-A")
    cells = [[str(r.get(c, "-")) for c in cols] for r in rows]
    widths = [min(max([len(c)] + [len(row[i]) for row in cells]), 60) for i, c in enumerate(cols)]
    line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"  # noqa: E731
    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(c) for c in cells)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".gpu-venv")
    parser.add_argument("--skip-install", action="store_true")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-tune", action="store_true")
    parser.add_argument(
        "--wheelhouse", type=Path, help="offline: install these wheels on PYTHONPATH, no venv, no tests"
    )
    parser.add_argument(
        "--budget", type=float, default=BUDGET_S, help=f"seconds for the whole check (default {BUDGET_S:.0f})"
    )
    parser.add_argument("--tune-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--load-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tune_worker:
        tune_worker(args.tune_worker, args.deadline)
        return 0
    if args.load_worker:
        load_worker(args.load_worker, args.deadline)
        return 0
    global budget_s
    budget_s = args.budget

    if args.wheelhouse:
        install_wheelhouse(args.wheelhouse)
        args.skip_install = args.skip_tests = True
    facts = machine_facts(sys.executable)
    if facts is None or not facts["gpu"] or not facts["cuda"]:
        print(
            "no CUDA device is visible to torch here: this check needs an NVIDIA GPU and a CUDA torch", file=sys.stderr
        )
        return 2
    print(
        f"GPU: {facts['gpu']} (sm {facts['cc']}, {facts['gpus']} device(s)), torch {facts['torch']}, CUDA {facts['cuda']}"
    )
    notes = [] if args.skip_install else install(args.venv, facts)
    python = venv_python(args.venv) if Path(venv_python(args.venv)).exists() else sys.executable
    workdir = Path(tempfile.mkdtemp(prefix="aitune-gpu-check-"))
    results = {} if args.skip_tests else tests(python, workdir)
    rows: list[dict[str, Any]] = []
    if not args.skip_tune:
        removed = check_toolchain(python)
        rows, out_of_time = tune_and_load(python, workdir, removed)
        rows += missing_rows(rows, planned_rows(facts["cc"]), out_of_time)

    print("\n## GPU check\n")
    print(f"{facts['gpu']}, torch {facts['torch']}, CUDA {facts['cuda']}; logs in {workdir}\n")
    if rows:
        print(table(rows) + "\n")
    for member, result in results.items():
        print(f"- tests {member}: {result}")
    for note in notes:
        print(f"- install: {note}")
    code, summary = verdict(rows, results, notes)
    print(f"\n{summary}; {time.monotonic() - START:.0f}s in all (budget {budget_s:.0f}s)")
    return code


def status(row: dict[str, Any]) -> str:
    """``ok``, ``not installed`` (the image lacks what the row needs), ``not run`` (the time given
    did not reach it, or its load) or ``failed``: not built, crashed, missing or hung, a silent
    fallback, a precision other than asked for, a wrong output, a load error or a wrong output
    after loading."""
    build, load = str(row.get("build", "")), str(row.get("load", "-"))
    if build.startswith(NOT_INSTALLED):
        return "not installed"
    if build.startswith(NOT_RUN):
        return "not run"
    wrong = (
        "correct" not in row
        or build.startswith("silent fallback")
        or str(row.get("precision", "")).startswith("MISMATCH")
        or str(row.get("correct", "")).startswith("NO")
        or str(row.get("A-B-A", "")).startswith("NO")
    )
    if wrong:
        return "failed"
    if load.startswith(NOT_RUN):
        return "not run"
    return "ok" if load == "-" or load[:1].isdigit() else "failed"


def failures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows that fail the check (:func:`status` ``failed``)."""
    return [row for row in rows if status(row) == "failed"]


def verdict(rows: list[dict[str, Any]], results: dict[str, str], notes: list[str]) -> tuple[int, str]:
    """The exit status and the summary line: 1 on a failed row, a failed or timed-out test member, an
    install that failed, or a tune that verified nothing (every row not installed or not run)."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[status(row)] = counts.get(status(row), 0) + 1
    summary = "rows: " + ", ".join(
        f"{counts.get(k, 0)} {k}" for k in ("ok", "failed", "not installed", "not run")
    )  # fmt: skip
    failed_tests = [m for m, r in results.items() if r.startswith(("FAILED", "TIMED OUT"))]
    failed_notes = [n for n in notes if NOT_INSTALLED not in n]
    nothing = bool(rows) and not counts.get("ok") and not counts.get("failed")
    if nothing:
        summary += "; nothing was verified (every row was not installed here or not run)"
    return (1 if failed_tests or counts.get("failed") or failed_notes or nothing else 0), summary


if __name__ == "__main__":
    sys.exit(main())
