"""The GPU check's plan, checked on a CPU: what it installs, in what order it tests, what it prints.

The run itself needs an NVIDIA GPU (``nox -s gpu``); these tests keep its install plan in step with
the members' metadata, so the one command does not drift from what users install.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
import types
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


# -- compilers and headers, checked up front ---------------------------------------------------


def _bin(folder: Path, *names: str) -> str:
    folder.mkdir(exist_ok=True)
    for name in names:
        tool = folder / name
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755)
    return str(folder)


def _include(folder: Path, header: bool = True) -> str:
    folder.mkdir(exist_ok=True)
    if header:
        (folder / "Python.h").write_text("/* */\n")
    return str(folder)


def test_an_image_with_compilers_and_headers_loses_no_row(check, tmp_path):
    found = check.toolchain(_include(tmp_path / "inc"), {"PATH": _bin(tmp_path / "bin", "gcc", "g++")})
    assert found["cc"] == str(tmp_path / "bin" / "gcc") and found["cxx"] == str(tmp_path / "bin" / "g++")
    assert found["python_h"] == str(tmp_path / "inc" / "Python.h")
    assert check.removed_rows(found) == {}


def test_without_python_headers_every_triton_row_is_removed_and_says_why(check, tmp_path):
    found = check.toolchain(_include(tmp_path / "inc", header=False), {"PATH": _bin(tmp_path / "bin", "gcc", "g++")})
    removed = check.removed_rows(found)
    assert set(removed) == set(check.TRITON_ROWS)
    assert {"torchao int8wo", "inductor", "inductor aot"} <= set(removed)
    assert all(
        "Python.h: install python3-dev" in why and "Triton compiles its launcher" in why for why in removed.values()
    )
    assert not any(row.startswith(("tensorrt", "torch_tensorrt", "ort")) for row in removed)


def test_triton_takes_cc_as_given_else_gcc_else_clang(check, tmp_path):
    path = _bin(tmp_path / "bin", "clang", "g++", "mycc")
    inc = _include(tmp_path / "inc")
    assert check.toolchain(inc, {"PATH": path})["cc"] == str(tmp_path / "bin" / "clang")
    assert check.toolchain(inc, {"PATH": path, "CC": "mycc"})["cc"] == str(tmp_path / "bin" / "mycc")
    missing = check.toolchain(inc, {"PATH": path, "CC": "gcc-14"})
    assert missing["cc"] is None, "Triton runs $CC as given: a CC that is not there is no compiler"
    assert "no C compiler (gcc-14 on PATH, or $CC)" in check.removed_rows(missing)["torchao int8dq"]


def test_without_a_cpp_compiler_the_inductor_rows_go_and_torchao_stays(check, tmp_path):
    found = check.toolchain(_include(tmp_path / "inc"), {"PATH": _bin(tmp_path / "bin", "gcc")})
    removed = check.removed_rows(found)
    assert set(removed) == set(check.CXX_ROWS) and "no C++ compiler (g++ is not on PATH)" in removed["inductor"]
    assert check.toolchain(_include(tmp_path / "inc"), {"PATH": _bin(tmp_path / "bin"), "CXX": "gcc"})["cxx"]
    bare = check.removed_rows(check.toolchain(_include(tmp_path / "none", header=False), {"PATH": ""}))
    assert "no C++ compiler" in bare["inductor"] and "Python.h" in bare["inductor"], "every reason a row has"
    assert "no C++ compiler" not in bare["torchao int8wo"]


def test_the_headers_are_looked_for_where_triton_looks(check):
    import sysconfig

    scheme = sysconfig.get_default_scheme()
    expected = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    assert check.python_include(sys.executable) == expected


def test_the_check_says_up_front_which_rows_the_toolchain_removes(check, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", _bin(tmp_path / "bin", "g++"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(check, "python_include", lambda python: _include(tmp_path / "inc"))
    removed = check.check_toolchain(sys.executable)
    out = capsys.readouterr().out
    assert "C compiler: none (gcc or clang)" in out and "Python headers: " + str(tmp_path / "inc" / "Python.h") in out
    assert f"removes the rows {', '.join(check.TRITON_ROWS)}: no C compiler" in out
    assert set(removed) == set(check.TRITON_ROWS)


# -- a plan that fits the time given -----------------------------------------------------------


def test_the_plan_runs_rows_in_order_while_their_estimates_fit_and_skips_what_cannot_run(check, monkeypatch):
    monkeypatch.setattr(
        check, "ROW_COST_S", {"a": (50.0, 10.0), "big": (200.0, 0.0), "b": (20.0, 5.0), "gone": (9e9, 0)}
    )
    order = [("cnn", "a"), ("cnn", "gone"), ("cnn", "big"), ("cnn", "b"), ("encoder", "a")]
    planned = check.plan(order, {"gone": "not installed here: no tensorrt"}, 100.0)
    assert [what.split(" (")[0] for _, _, what in planned] == [
        "run", "not installed here: no tensorrt", "not run: out of time", "run", "not run: out of time",
    ]  # fmt: skip
    assert planned[2][2] == "not run: out of time (about 200s to tune and load, 40s left)"
    assert planned[3][2] == "run", "b: 20 s to tune, then 10 + 5 s of loads, within the 30 s floor: 50 s of the 50 left"
    assert [w for _, _, w in check.plan(order, {}, 1e6)].count("run") == 4, "all but the one costing 9e9 s"


def test_a_row_fits_only_with_the_loads_of_the_rows_saved_before_it(check):
    tune_s, load_s = check.ROW_COST_S["inductor"]
    assert check.fits("inductor", tune_s + check.LOAD_FLOOR_S, 0.0), "the fresh process gets its floor at least"
    assert not check.fits("inductor", tune_s + check.LOAD_FLOOR_S - 1, 0.0)
    assert check.fits("inductor", tune_s + load_s + 40, 40.0)
    assert not check.fits("inductor", tune_s + load_s + 40, 41.0), "the saved rows' loads come first"


def test_the_default_plan_for_an_offline_hopper_run_fits_the_cnn_rows_and_reports_the_rest(check):
    """What a lent H200 with no TensorRT, Torch-TensorRT or onnxruntime-gpu gets from 540 s after a
    one-minute install: fewer tunes, the rest "not run", none failing."""
    skip = {
        label: "not installed here" for label in check.BACKEND_LABELS if label.startswith(("tensorrt", "torch_", "ort"))
    }
    planned = check.plan(check.planned_rows([9, 0]), skip, check.BUDGET_S - 60 - check.FINISH_S)
    ran = [(m, b) for m, b, what in planned if what == "run"]
    assert ran and all(m == "cnn" for m, _ in ran)
    assert sum(sum(check.ROW_COST_S[b]) for _, b in ran) <= check.BUDGET_S - 60 - check.FINISH_S
    rows = [{"model": m, "backend": b, "build": w} for m, b, w in planned if w != "run"]
    assert rows and check.failures(rows) == []


def test_the_tune_worker_follows_the_plan_and_marks_each_row_it_starts(check, tmp_path, monkeypatch):
    pytest.importorskip("aitune.torch")
    import time

    import torch

    labels = ["a", "b", "c", "d", "e"]
    monkeypatch.setattr(check, "ROW_COST_S", dict.fromkeys(labels, (30.0, 10.0)))
    monkeypatch.setattr(check, "BACKEND_LABELS", tuple(labels))
    monkeypatch.setattr(check, "HOPPER_ONLY", ())
    monkeypatch.setattr(check, "MODELS", ("cnn", "encoder"))
    monkeypatch.setattr(check, "MODEL_BACKENDS", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(
        check, "models", lambda: {"cnn": (torch.nn.Identity(), []), "encoder": (torch.nn.Identity(), [])}
    )
    made = [(label, types.SimpleNamespace(name=f"backend {label}")) for label in labels]
    made[3] = ("d", RuntimeError("not installed here: no such runtime"))
    monkeypatch.setattr(check, "backends", lambda: made)
    monkeypatch.setattr(check, "_unavailable", lambda: {"backend c": "its library is missing"})
    tuned = []
    monkeypatch.setattr(
        check,
        "_tune_one",
        lambda ait, m, d, backend, artifact, label: tuned.append(label) or {"build": "1.0s", "artifact": str(artifact)},
    )
    (tmp_path / "removed.json").write_text(json.dumps({"b": "no C compiler"}))
    check.tune_worker(tmp_path, time.time() + 65)  # 40 s a row, plus 10 s to load each row saved before it
    rows = {(r["model"], r["backend"]): r["build"] for r in check._jsonl(tmp_path / "rows.jsonl")}
    assert tuned == ["a", "e", "a"], "the fourth runnable row needs 40 + 30 s, more than is left"
    assert rows[("encoder", "e")].startswith("not run: out of time (about 40s to tune and load")
    assert rows[("cnn", "b")] == "not installed here: no C compiler"
    assert rows[("cnn", "c")] == "not installed here: its library is missing"
    assert rows[("cnn", "d")] == "not installed here: no such runtime"
    assert rows[("encoder", "a")] == "1.0s"
    started = [(s["model"], s["backend"]) for s in check._jsonl(tmp_path / "started.jsonl")]
    assert started == [("cnn", "a"), ("cnn", "e"), ("encoder", "a")]


def test_an_availability_refusal_is_a_row_not_installed_here(check, tmp_path):
    """The ONNX Runtime TensorRT provider without libnvinfer.so.10 (or beside TensorRT 11) is refused
    by the backend's own probe at the availability stage: not a failure."""
    reason = "the TensorrtExecutionProvider of ONNX Runtime cannot run here: libnvinfer.so.10 is not found"
    candidate = types.SimpleNamespace(backend="onnxruntime", stage="availability", status="failed", reason=reason)
    report = types.SimpleNamespace(
        modules=[types.SimpleNamespace(graphs=[types.SimpleNamespace(candidates=[candidate])])]
    )
    ait = types.SimpleNamespace(
        MaxThroughputStrategy=lambda **kw: None,
        PerformanceValidationMode=types.SimpleNamespace(DIAGNOSTIC="diagnostic"),
        Module=lambda model, name, strategy: model,
        tune=lambda wrapped, data: report,
    )
    row = check._tune_one(
        ait, object(), [], types.SimpleNamespace(name="onnxruntime"), tmp_path / "x.ait", "ort tensorrt"
    )
    assert row == {"build": f"not installed here: {reason}"}
    assert check.status({"model": "cnn", "backend": "ort tensorrt", **row}) == "not installed"


# -- row statuses and the verdict --------------------------------------------------------------

OK_ROW = {"build": "2.0s", "precision": "fp32", "correct": "ok, rel err 1e-06", "load": "0.12s", "A-B-A": "ok: A 1e-06"}


def test_rows_the_time_did_not_reach_are_not_run_and_do_not_fail(check):
    assert check.status({"build": "not run: out of time (about 70s to tune and load, 12s left)"}) == "not run"
    assert check.status({**OK_ROW, "load": "not run: out of time"}) == "not run"
    assert check.status(OK_ROW) == "ok" and check.status({**OK_ROW, "load": "-"}) == "ok"
    assert check.status({**OK_ROW, "load": "not loaded (see above)"}) == "failed"
    planned = [("cnn", "inductor"), ("encoder", "inductor")]
    stopped = check.missing_rows([], planned, out_of_time=True)
    assert [r["build"] for r in stopped] == ["not run: out of time"] * 2 and check.failures(stopped) == []
    assert check.failures(check.missing_rows([], planned)) != [], "a crashed tune's missing rows fail"


def test_a_row_cut_off_by_the_time_limit_is_not_run_unless_it_had_hung(check):
    started = {"model": "cnn", "backend": "inductor aot", "started": 1000.0}
    cut = check.cut_off(started, 1000.0 + 42)
    assert cut["build"] == "not run: out of time, cut off 42s into its build" and check.status(cut) == "not run"
    hung = check.cut_off(started, 1000.0 + check.HANG_S)
    assert hung["build"].startswith("TIMED OUT: still building") and check.status(hung) == "failed"


def test_the_tune_stopped_for_time_reports_the_row_it_was_in_and_the_rest_not_run(check, tmp_path, monkeypatch):
    """The parent's side: the worker wrote one row and started a second when its time ran out."""
    import time

    def worker(cmd, timeout, log=None):
        if "--tune-worker" in cmd:
            (tmp_path / "rows.jsonl").write_text(json.dumps({"model": "cnn", "backend": "ort cuda", **OK_ROW}) + "\n")
            (tmp_path / "started.jsonl").write_text(
                json.dumps({"model": "cnn", "backend": "ort cuda", "started": time.time() - 30}) + "\n"
                + json.dumps({"model": "cnn", "backend": "inductor", "started": time.time() - 20}) + "\n"
            )  # fmt: skip
            return 124
        raise AssertionError("nothing was saved, so nothing loads")

    monkeypatch.setattr(check, "run", worker)
    rows, out_of_time = check.tune_and_load(sys.executable, tmp_path, {})
    assert out_of_time and json.loads((tmp_path / "removed.json").read_text()) == {}
    assert rows[1]["backend"] == "inductor" and rows[1]["build"].startswith("not run: out of time, cut off")
    rows += check.missing_rows(rows, [("cnn", "ort cuda"), ("cnn", "inductor"), ("encoder", "inductor")], out_of_time)
    assert [check.status(r) for r in rows] == ["ok", "not run", "not run"]


def test_the_verdict_fails_on_real_defects_only_and_on_a_check_that_verified_nothing(check):
    not_installed = {"build": "not installed here: tensorrt is not installed"}
    not_run = {"build": "not run: out of time"}
    assert check.verdict([OK_ROW, not_installed, not_run], {}, []) == (
        0, "rows: 1 ok, 0 failed, 1 not installed, 1 not run",
    )  # fmt: skip
    code, summary = check.verdict([not_installed, not_run], {}, [])
    assert code == 1 and "nothing was verified" in summary
    assert check.verdict([OK_ROW, {**OK_ROW, "correct": "NO: off"}], {}, [])[0] == 1
    assert check.verdict([OK_ROW], {"aitune-core": "FAILED (1): 1 failed"}, [])[0] == 1
    assert check.verdict([OK_ROW], {}, ["Torch-TensorRT not installed here: torch 2.20 has no tested release"])[0] == 0
    assert check.verdict([OK_ROW], {}, ["TensorRT failed to install (see the log above)"])[0] == 1
    assert check.verdict([], {}, [])[0] == 0, "--skip-tune: no rows, nothing to verify"


def test_a_run_stopped_for_time_with_rows_not_installed_passes_and_says_what_it_did(check, monkeypatch, capsys):
    """main on a stand-in GPU machine: the toolchain's removals reach the tune, planned rows the time
    did not reach print as not run, and the exit status is 0."""
    facts = {"gpu": "NVIDIA H200", "cuda": "13.0", "torch": "2.11.0+cu130", "cc": [9, 0], "gpus": 1}
    monkeypatch.setattr(check, "machine_facts", lambda python: facts)
    monkeypatch.setattr(check, "check_toolchain", lambda python: {"inductor aot": "no C++ compiler"})
    seen = {}

    def tune_and_load(python, workdir, removed):
        seen["removed"] = removed
        return [
            {"model": "cnn", "backend": "inductor aot", "build": "not installed here: no C++ compiler"},
            {"model": "cnn", "backend": "torchao int8wo", **OK_ROW},
        ], True

    monkeypatch.setattr(check, "tune_and_load", tune_and_load)
    monkeypatch.setattr(check, "budget_s", check.budget_s)  # main sets it; put back after the test
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--skip-install", "--skip-tests", "--budget", "300"])
    assert check.main() == 0
    out = capsys.readouterr().out
    assert seen["removed"] == {"inductor aot": "no C++ compiler"} and check.budget_s == 300
    planned = len(check.planned_rows([9, 0]))
    assert f"rows: 1 ok, 0 failed, 1 not installed, {planned - 2} not run" in out and "(budget 300s)" in out
    bf16 = [line for line in out.splitlines() if line.startswith("| cnn bf16 ")]
    assert len(bf16) == 3 and all("not run: out of time" in line for line in bf16)
