"""The GPU check's plan, checked on a CPU: what it installs, in what order it tests, what it prints.

The run itself needs an NVIDIA GPU (``nox -s gpu``); these tests keep its install plan in step with
the members' metadata, so the one command does not drift from what users install.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports neither torch nor aitune
    return module


def test_the_script_itself_imports_no_runtime(check):
    assert "torch" not in vars(check) and "aitune" not in vars(check)


def test_tensorrt_comes_as_the_wheel_of_torchs_cuda_major(check):
    cu13 = check.tensorrt_runtime(13)
    assert any(r.startswith("tensorrt-cu13>=10") for r in cu13) and not any("cu12" in r for r in cu13)
    assert "nvidia-modelopt>=0.44" in cu13
    assert check.torch_minor("2.13.0+cu128") == (2, 13)


def test_torch_tensorrt_extras_cover_exactly_the_tested_torch_minors(check):
    from aitune_backend_torchtrt.versions import TESTED

    assert check.TORCHTRT_TESTED == TESTED
    extras = set(importlib.metadata.metadata("aitune-backend-torchtrt").get_all("Provides-Extra") or [])
    assert {f"torch{a}{b}" for a, b in [(2, m) for m in range(TESTED[0][1], TESTED[1][1] + 1)]} <= extras


def test_every_member_with_gpu_tests_gets_a_budget_torchtrt_first_and_the_tune_keeps_its_share(check):
    members = [m for m, _ in check.TEST_BUDGETS]
    assert members[0] == "aitune-backend-torchtrt"
    with_gpu_tests = {p.parent.parent.name for p in ROOT.glob("aitune-*/tests/test_gpu*.py")}
    assert with_gpu_tests <= set(members)
    assert sum(b for _, b in check.TEST_BUDGETS) + check.TUNE_RESERVE_S <= check.BUDGET_S


def test_the_table_has_one_row_per_pair_and_the_documented_columns(check):
    rows = [
        {"model": "cnn", "backend": "ort cuda", "build": "3.1s", "correct": "ok, rel err 2.0e-06", "speedup": "1.80x"},
        {"model": "cnn", "backend": "ort tensorrt", "build": "availability: its TensorRT library ..."},
    ]
    lines = check.table(rows).splitlines()
    assert lines[0].replace(" ", "") == "|model|backend|build|precision|correct|speedup|load|A-B-A|"
    assert len(lines) == 4 and "availability" in lines[3] and lines[3].count("| -") == 5, "a missing cell is '-'"
    documented = (ROOT / "scripts" / "README.md").read_text()
    assert "| model | backend | build | precision | correct | speedup | load | A-B-A |" in documented


def test_a_lowered_row_whose_error_is_fp32_sized_is_a_precision_mismatch(check):
    """An fp16 engine built fp32 passes the fp16 bound; only its too-small error gives it away."""
    assert check.precision_cell("torchao int8wo", "fp32", 3e-3, {}) == "int8: error 3.0e-03"
    mismatch = check.precision_cell("tensorrt fp16+graphs", "fp32", 4e-7, {})
    assert mismatch.startswith("MISMATCH: asked fp16") and "floor 2e-05" in mismatch
    assert check.precision_cell("inductor", "bf16", 0.0, {}) == "bf16", "a row at the model's own dtype has no floor"
    counted = check.precision_cell("tensorrt fp16+graphs", "fp32", 4e-7, {"layer_precisions": {"fp16": 9, "fp32": 2}})
    assert counted == "fp16: layers fp16 9, fp32 2", "the engine's own layer count beats the error heuristic"


def test_a_row_that_ran_elsewhere_than_its_name_is_a_silent_fallback(check):
    assert check.fallback("torch_tensorrt_aot", {"tensorrt_subgraphs": 0}).startswith("silent fallback")
    assert check.fallback("torch_tensorrt_aot", {"tensorrt_subgraphs": 2}) is None
    cpu = {"session_providers": ["CPUExecutionProvider"]}
    assert "not CUDAExecutionProvider" in check.fallback("ort cuda", cpu)
    assert check.fallback("ort cuda", {"session_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]}) is None
    assert check.fallback("inductor", {}) is None


def test_without_a_cuda_torch_it_says_so_and_exits_2(check, monkeypatch, capsys):
    monkeypatch.setattr(check, "machine_facts", lambda python: {"gpu": None, "cuda": None})
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--skip-install"])
    assert check.main() == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def _wheel(folder: Path, name: str) -> Path:
    """A minimal wheel holding one module, made by hand (no network, no build backend)."""
    import base64
    import hashlib
    import zipfile

    path = folder / f"{name}-0.1-py3-none-any.whl"
    files = {f"{name}.py": b"MARK = 1\n", f"{name}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode(),
             f"{name}-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}  # fmt: skip
    record = "".join(
        f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}\n"
        for n, d in files.items()
    )
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"{name}-0.1.dist-info/RECORD", record + f"{name}-0.1.dist-info/RECORD,,\n")
    return path


def test_the_offline_check_installs_the_wheelhouse_on_pythonpath_then_stops_without_cuda(tmp_path):
    """What a CPU-only container shows: the wheels install offline beside the machine's torch, aitune
    imports, and the check stops at the first CUDA call with exit 2."""
    import os
    import subprocess

    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the check would run for minutes: see scripts/README.md")
    house = tmp_path / "wheelhouse"
    house.mkdir()
    _wheel(house, "aitune_offline_marker")
    env = {k: v for k, v in os.environ.items() if k != "PIP_INDEX_URL"} | {"PIP_NO_INDEX": "1"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--wheelhouse", str(house)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no CUDA device" in out.stderr
    assert "--no-index --no-deps" in out.stdout and "aitune 0" in out.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--wheelhouse", str(empty)],
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0 and "gpu_wheelhouse.sh" in refused.stderr


def test_rows_the_machine_cannot_run_do_not_fail_the_check_but_wrong_outputs_do(check):
    ok = {"build": "2.0s", "precision": "fp32", "correct": "ok, rel err 1e-06", "load": "0.12s", "A-B-A": "ok: A 1e-06"}
    rows = [
        {"build": "not installed here: tensorrt is not installed"},
        ok,
        {"build": "2.0s", "correct": "NO: off by 3; rel err 3e+00"},
        {**ok, "load": "ArtifactError: boom"},
        {"build": "validate: failed"},
        {**ok, "A-B-A": "NO: A 1e-06, B 1e-06, A 9e-01, b=1 1e-06, bound 1e-03"},
        {**ok, "precision": "MISMATCH: asked fp16, error 4.0e-07 is under fp16's floor 2e-05"},
        {**ok, "build": "silent fallback: no TensorRT engine in the compiled module"},
    ]
    assert check.failures(rows) == rows[2:]


def test_a_tune_that_ended_early_leaves_missing_rows_that_fail_the_check(check):
    """A tune that timed out or crashed wrote a partial table: every planned row must exist."""
    planned = check.planned_rows([8, 0])
    assert ("cnn", "ort tensorrt") in planned and ("encoder", "tensorrt fp16+graphs") in planned
    assert ("cnn bf16", "ort cuda") not in planned, "bf16 is Inductor's rows only"
    assert not any(b == "torchao fp8wo" for _, b in planned) and ("cnn", "torchao fp8wo") in check.planned_rows([9, 0])
    written = [{"model": "cnn", "backend": "inductor aot", "build": "2.0s", "correct": "ok", "load": "0.1s"}]
    missing = check.missing_rows(written, planned)
    assert len(missing) == len(planned) - 1 and all(r["build"].startswith("missing") for r in missing)
    assert check.failures(missing) == missing
    assert check.missing_rows([{"model": m, "backend": b} for m, b in planned], planned) == []


def test_the_planned_rows_are_the_rows_the_tune_makes(check):
    pytest.importorskip("aitune.torch")
    labels = [label for label, _ in check.backends()]  # on CPU: no Hopper, so no fp8 row
    assert labels == [b for b in check.BACKEND_LABELS if b not in check.HOPPER_ONLY]


def test_numpy_onnx_and_protobuf_come_from_the_wheelhouse_only_where_the_image_lacks_them(check, tmp_path):
    wheels = [tmp_path / n for n in ("numpy-2.3.0-cp312-cp312-manylinux_2_28_x86_64.whl",
              "onnx-1.19.0-cp312-cp312-manylinux_2_17_x86_64.whl", "onnx_ir-0.1.10-py3-none-any.whl",
              "protobuf-6.31.1-cp39-abi3-manylinux2014_x86_64.whl", "torchao-0.18.0-py3-none-any.whl")]  # fmt: skip
    install, kept = check.wheels_to_install(wheels, lambda module: module in {"numpy", "google.protobuf"})
    assert kept == ["numpy", "protobuf"], "never shadow the numpy torch was built with"
    assert [check.wheel_distribution(w) for w in install] == ["onnx", "onnx-ir", "torchao"]
    install, kept = check.wheels_to_install(wheels, lambda module: False)
    assert install == wheels and kept == []
    script = (ROOT / "scripts" / "gpu_wheelhouse.sh").read_text()
    assert "onnx-ir ml_dtypes numpy onnx protobuf" in script
