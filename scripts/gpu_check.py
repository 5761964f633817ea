#!/usr/bin/env python
"""The GPU check: one command, on a machine with an NVIDIA GPU, within 10 minutes.

    python scripts/gpu_check.py [--skip-install] [--skip-tests] [--skip-tune]

1. installs what the GPU paths need into the current environment: every member (editable), the
   ``[runtime]`` extras of aitune-backend-tensorrt and aitune-backend-torchtrt, the TensorRT
   member's ``[test]`` extra (ModelOpt's ONNX tools) and onnxruntime-gpu;
2. runs every ``gpu``-marked test of every member and of the cross-distribution tests;
3. tunes a small CNN and a transformer encoder layer with TensorRT, ONNX Runtime (CUDA provider),
   Inductor and eager, one backend at a time, saves and reloads each result, and prints one table:
   speedup over eager, max abs error against eager, build time, load time.

Every step and every backend is caught on its own: a failure is printed and the check goes on.
The exit status is non-zero when the tests failed or no backend could be tuned.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 570.0
START = time.monotonic()


def left() -> float:
    return BUDGET_S - (time.monotonic() - START)


def step(title: str) -> None:
    print(f"\n=== {title} ({left():.0f}s left) ===", flush=True)


def run(cmd: list[str], timeout: float) -> int:
    print("$", " ".join(cmd), flush=True)
    try:
        return subprocess.run(cmd, cwd=ROOT, timeout=max(timeout, 1)).returncode
    except subprocess.TimeoutExpired:
        print(f"timed out after {timeout:.0f}s", flush=True)
        return 124


# -- 1. install ------------------------------------------------------------------------------


def install() -> None:
    step("install")
    pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    members = sorted(p.name for p in ROOT.glob("aitune-*") if (p / "pyproject.toml").is_file())
    extras = {"aitune-backend-tensorrt": "[runtime,test]", "aitune-backend-torchtrt": "[runtime]"}
    editable = [arg for m in members for arg in ("-e", f"./{m}{extras.get(m, '')}")]
    if run([*pip, *editable], timeout=min(240, left() - 300)) != 0:
        print("installing the members failed; going on with what is installed", flush=True)
    # onnxruntime-gpu ships the same `onnxruntime` module as the CPU wheel the onnxruntime
    # member depends on; installed last, its files win and the CUDA provider appears.
    run([*pip, "onnxruntime-gpu"], timeout=min(120, left() - 280))
    if "CUDAExecutionProvider" not in _ort_providers():
        run([*pip, "--force-reinstall", "--no-deps", "onnxruntime-gpu"], timeout=min(120, left() - 280))
    print("onnxruntime providers:", _ort_providers(), flush=True)


def _ort_providers() -> list[str]:
    code = "import onnxruntime as o; print(','.join(o.get_available_providers()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return out.stdout.strip().split(",") if out.returncode == 0 else []


# -- 2. the gpu-marked tests -----------------------------------------------------------------


def tests() -> int:
    step("gpu-marked tests")
    paths = [str(p.relative_to(ROOT)) for p in sorted(ROOT.glob("aitune-*/tests"))]
    if (ROOT / "tests").is_dir():
        paths.append("tests")
    return run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", *paths],
        timeout=min(300, left() - 180),
    )


# -- 3. tune two small models with each backend ----------------------------------------------


def models() -> dict[str, tuple[Any, list[Any]]]:
    import torch

    torch.manual_seed(0)
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
    )  # fmt: skip
    layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    return {
        "cnn": (cnn.eval().cuda(), [torch.randn(b, 3, 64, 64, device="cuda") for b in (8, 16, 16, 32)]),
        "transformer": (
            layer.eval().cuda(),
            [torch.randn(b, s, 256, device="cuda") for b, s in ((4, 64), (8, 128), (8, 128), (16, 96))],
        ),
    }


def backends() -> list[tuple[str, Any]]:
    from aitune.torch import backend as b

    wanted = [
        ("tensorrt", lambda: b.TensorRTBackend()),
        ("onnxruntime-cuda", lambda: b.ONNXRuntimeBackend(b.ONNXRuntimeBackendConfig(execution_provider="cuda"))),
        ("inductor", lambda: b.TorchInductorJitBackend()),
        ("eager", lambda: b.TorchEagerBackend()),
    ]
    out = []
    for label, make in wanted:
        try:
            out.append((label, make()))
        except Exception as exc:
            out.append((label, exc))
    return out


def tune_one(label: str, backend: Any, model: Any, data: list[Any], workdir: Path) -> dict[str, Any]:
    import torch

    import aitune.torch as ait

    row: dict[str, Any] = {"backend": label}
    if isinstance(backend, Exception):
        return {**row, "status": f"not available: {backend}"}
    wrapped = ait.Module(copy.deepcopy(model), "m", strategy=ait.MaxThroughputStrategy(backends=[backend]))
    report = ait.tune(wrapped, data)
    candidates = [c for g in report.modules[0].graphs for c in g.candidates if c.backend == backend.name]
    if not candidates:
        return {**row, "status": f"no candidate ran: {report.modules[0].error or report.modules[0].summary}"}
    c = candidates[0]
    errors = [o.max_abs_error for o in (c.validation.outputs if c.validation else [])]
    row.update(
        status=c.status if not c.reason else f"{c.status}: {c.reason}",
        speedup=c.speedup,
        max_error=max(errors) if errors else None,
        build_s=c.build_time_s,
    )
    path = workdir / f"{label}.ait"
    ait.save(wrapped, path)
    fresh = ait.Module(copy.deepcopy(model), "m")
    torch.cuda.synchronize()
    start = time.perf_counter()
    ait.load(fresh, path)
    torch.cuda.synchronize()
    row["load_s"] = time.perf_counter() - start
    with torch.no_grad():
        got, want = fresh(data[0]), model(data[0])
    row["loaded_error"] = float((got.float() - want.float()).abs().max())
    return row


def tune_all() -> list[dict[str, Any]]:
    import torch

    step("tune")
    rows = []
    workdir = Path(tempfile.mkdtemp(prefix="aitune-gpu-check-"))
    try:
        for model_name, (model, data) in models().items():
            for label, backend in backends():
                if left() < 30:
                    rows.append({"model": model_name, "backend": label, "status": "skipped: out of time"})
                    continue
                print(f"-- {model_name} / {label}", flush=True)
                try:
                    row = tune_one(label, backend, model, data, workdir)
                except Exception as exc:
                    traceback.print_exc()
                    row = {"backend": label, "status": f"failed: {type(exc).__name__}: {str(exc)[:200]}"}
                rows.append({"model": model_name, **row})
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def table(rows: list[dict[str, Any]]) -> None:
    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    header = f"{'model':<12} {'backend':<17} {'speedup':>8} {'max err':>9} {'loaded err':>10} {'build s':>8} {'load s':>7}  status"
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r['model']:<12} {r['backend']:<17} {fmt(r.get('speedup'), '8.2f')} {fmt(r.get('max_error'), '9.2e')} "
            f"{fmt(r.get('loaded_error'), '10.2e')} {fmt(r.get('build_s'), '8.1f')} {fmt(r.get('load_s'), '7.2f')}  "
            f"{r.get('status', '')}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-install", action="store_true")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-tune", action="store_true")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device is visible to torch: this check needs an NVIDIA GPU", file=sys.stderr)
        return 2
    print(
        f"GPU: {torch.cuda.get_device_name()} (compute capability {torch.cuda.get_device_capability()}), "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}",
        flush=True,
    )
    if not args.skip_install:
        install()
        importlib.invalidate_caches()
    status = 0 if args.skip_tests else tests()
    rows = [] if args.skip_tune else tune_all()
    if rows:
        table(rows)
    tuned = [r for r in rows if r.get("speedup") is not None]
    print(
        f"\ntests: {'skipped' if args.skip_tests else 'passed' if status == 0 else f'FAILED ({status})'}; "
        f"tuned {len(tuned)} of {len(rows)} model/backend pairs; {time.monotonic() - START:.0f}s in all"
    )
    return 1 if status != 0 or (rows and not tuned) else 0


if __name__ == "__main__":
    sys.exit(main())
