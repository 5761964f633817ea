"""The harness's own logic, cheaply: flags, statistics and the table (``pytest benchmarks``)."""

from __future__ import annotations

from benchmarks.__main__ import CASE_NAMES, parse
from benchmarks.measure import interleaved, spread
from benchmarks.models import CASES
from benchmarks.report import markdown


def test_quick_defaults_are_lighter_than_full() -> None:
    quick, full = parse(["--quick"]), parse([])
    assert quick.batch_sizes == [1, 8] and full.batch_sizes == [1, 8, 32]
    assert quick.repeats < full.repeats and quick.cold_start_models == ["mlp"]
    assert quick.tune_time_models == ["mlp"] and full.tune_time_models == ["mlp", "encoder"]
    assert list(CASE_NAMES) == list(CASES)


def test_spread_is_median_and_quartiles() -> None:
    s = spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["median"], s["q1"], s["q3"], s["min"], s["max"]) == (3.0, 2.0, 4.0, 1.0, 5.0)


def test_interleaved_times_every_contender_every_round() -> None:
    calls = {"a": 0, "b": 0}

    def bump(name: str):  # type: ignore[no-untyped-def]
        return lambda: calls.__setitem__(name, calls[name] + 1)

    stats = interleaved({"a": bump("a"), "b": bump("b")}, steps=4, repeats=3, warmup=1)
    assert calls == {"a": 13, "b": 13} and stats["a"]["n"] == stats["b"]["n"] == 3


def test_markdown_marks_a_missed_pick_and_a_failed_backend() -> None:
    stat = {"median": 2.0, "q1": 1.9, "q3": 2.1, "min": 1.8, "max": 2.2, "n": 3}
    results = {
        "machine": {"cpu": "Test CPU", "cores": 2, "torch": "2.x", "torch_threads": 1, "OMP_NUM_THREADS": "1",
                    "OMP_WAIT_POLICY": "ACTIVE", "python": "3.11"},
        "settings": {"device": "cpu", "quick": True, "repeats": 3, "steps": 4, "batch_sizes": [8]},
        "backends": ["onnxruntime", "torch_inductor_aot"],
        "skipped_backends": {"tensorrt": "needs CUDA"},
        "cases": [{
            "case": "mlp",
            "oracle": {"onnxruntime": {"ok": True, "build_s": 1.0, "modules": {"mlp": {
                "max_rel_error": 1e-7, "cosine": 1.0}}}, "torch_inductor_aot": {"ok": False, "error": "boom"}},
            "batches": [{
                "batch": 8, "oracle_best": "onnxruntime",
                "stats": {"eager": {**stat, "speedup": 1.0}, "backend:onnxruntime": {**stat, "speedup": 2.0},
                          "strategy:first_wins": {**stat, "speedup": 1.5}},
                "picks": {"first_wins": {"decisions": ["torch_eager"], "picked_best": False, "miss": 0.33}},
            }],
        }],
    }  # fmt: skip
    text = markdown(results)
    assert "Test CPU" in text and "`tensorrt`: needs CUDA" in text
    assert "| mlp | 8 | 2 (1.9–2.1) | 2.00x | failed | ort |" in text
    assert "no, +33% vs best" in text and "mlp / inductor-aot: boom" in text
    assert "- first_wins: 0 of 1" in text


def test_a_pick_inside_the_spread_of_the_fastest_counts_as_met() -> None:
    stat = {"median": 2.0, "q1": 1.9, "q3": 2.1, "min": 1.8, "max": 2.2, "n": 3}
    results = {
        "machine": {"cpu": "Test CPU", "cores": 2, "torch": "2.x", "torch_threads": 1, "OMP_NUM_THREADS": "1",
                    "OMP_WAIT_POLICY": "ACTIVE", "python": "3.11"},
        "settings": {"device": "cpu", "quick": True, "repeats": 3, "steps": 4, "batch_sizes": [8]},
        "backends": ["onnxruntime"], "skipped_backends": {},
        "cases": [{
            "case": "mlp", "oracle": {"onnxruntime": {"ok": True, "build_s": 1.0, "modules": {}}},
            "batches": [{
                "batch": 8, "oracle_best": "onnxruntime",
                "stats": {"eager": {**stat, "speedup": 1.0}, "backend:onnxruntime": {**stat, "speedup": 2.0},
                          "strategy:max_throughput": {**stat, "speedup": 1.9}},
                "picks": {"max_throughput": {"decisions": ["torch_inductor_aot"], "picked_best": False,
                                             "miss": 0.02, "within_spread": True, "slower_than_eager": False}},
            }],
        }],
    }  # fmt: skip
    text = markdown(results)
    assert "within the spread (+2%)" in text and "- max_throughput: 1 of 1" in text


def test_the_peers_table_shows_speedups_and_failures() -> None:
    from benchmarks.hf import main as hf_main
    from benchmarks.peers import OWN_GRAPH, markdown

    stats = {"median": 2.0, "q1": 1.9, "q3": 2.1}
    results = {
        "cases": [
            {
                "case": "bert",
                "contenders": {
                    "ORT dynamo": {"pick": ["onnxruntime"], "max_rel_error": 1e-6},
                    "ORT torchscript": {"error": "BuildError: x"},
                    OWN_GRAPH: {"pick": ["onnxruntime session on the ONNX file aitune's session opens"]},
                },
                "timing_ms": {
                    "1": {"eager": {"median": 4.0, "q1": 3.9, "q3": 4.1}, "ORT dynamo": stats, OWN_GRAPH: stats},
                    "8": {"eager": {"median": 4.0, "q1": 3.9, "q3": 4.1}, "ORT dynamo": stats},
                },
            }
        ]
    }
    text = markdown(results)
    assert "| bert | 1 | 4.00 | 2.00x [1.90-2.11] | failed | 2.00x [1.90-2.11] |" in text
    assert "| bert | 8 | 4.00 | 2.00x [1.90-2.11] | failed | no ONNX Runtime graph at this size |" in text, (
        "where the pick runs another runtime, there is no graph of its own to run by hand: not a failure"
    )
    assert "BuildError: x" in text
    assert callable(hf_main)


def test_the_serving_table_shows_each_setup_and_what_the_kill_run_lost() -> None:
    from benchmarks.serving import _tuned_share, markdown

    share = _tuned_share([{"batches_by_backend": {"f=onnxruntime": 3, "h=torch_eager": 1}}, {"batches_by_backend": {}}])
    assert share == 0.75
    setup = {"throughput_rps": 100.0, "p50_ms": 5.0, "p99_ms": 9.0, "mean_batch_size": 4.5, "tuned_share": share}
    kill = {"answered": 98, "failures": ["HTTP 500: x", "HTTP 500: x"], "answered_on_retry": 1, "lost": 1}
    table = markdown(
        {
            "machine": "m",
            "clients": 2,
            "requests": 100,
            "warmup": 5,
            "threads": 1,
            "setups": {"demo": {"(c)": setup}},
            "kill": kill,
        }
    )
    assert "| demo | (c) | 100.0 | 5.0 | 9.0 | 4.50 | 75% |" in table
    assert "2 failed and then 1 answered on retry, 1 lost" in table and "2 x `HTTP 500: x`" in table


def test_each_serving_setup_runs_its_own_server_and_pytriton_finds_its_libpython(tmp_path) -> None:
    """(d) and (e) are ``aitune serve`` itself, (f) this checkout's kserve server by hand, (h) PyTriton's
    server from the interpreter given, with that interpreter's LIBDIR first on the loader's path (its
    stub links libpython, which under pyenv is not where the system looks)."""
    import argparse
    import os
    import sys
    import sysconfig

    from benchmarks.serving import server_command

    args = argparse.Namespace(threads=2, pytriton_python=sys.executable)
    artifact, onnx = tmp_path / "bert.ait", tmp_path / "bert.onnx"
    tuned, _ = server_command("bert", artifact, args, 8123)
    assert tuned[1:5] == ["-m", "aitune", "serve", str(artifact)] and "--eager" not in tuned
    assert tuned[tuned.index("--port") + 1] == "8123" and tuned[tuned.index("--threads") + 1] == "2"
    assert server_command("bert", artifact, args, 8123, eager=True)[0][-1] == "--eager"
    kserve, _ = server_command("bert", artifact, args, 8123, by_hand=onnx)
    assert kserve[:5] == [sys.executable, "-m", "benchmarks.serving", "--serve-kserve-by-hand", str(onnx)]
    triton, env = server_command("bert", artifact, args, 8123, by_hand=onnx, hand="triton")
    assert triton[:5] == [sys.executable, "-m", "benchmarks.serving", "--serve-triton-by-hand", str(onnx)]
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == sysconfig.get_config_var("LIBDIR")


def test_overhead_benchmark_runs_the_wrapper_tuned_and_reports_the_machine() -> None:
    import torch

    from benchmarks.overhead import constant_module, machine, markdown, per_call_us

    for case in ("linear", "bert"):
        call, direct = constant_module(case)
        with torch.inference_mode():
            assert call() is direct(), "the wrapped call is served by the installed backend, not eager"
            row = per_call_us(call, direct, rounds=3, calls=5)
        assert row["q1"] <= row["us"] <= row["q3"]
    text = markdown({"machine": machine(), "load_before": (1.0, 2.0, 3.0), "load_after": (1.5, 2.0, 3.0),
                     "rows": [{"case": "linear", "mode": "inference_mode", **row}]})  # fmt: skip
    assert "load average (1, 5, 15 min) 1.00, 2.00, 3.00 before" in text and "Linear(16, 16)" in text


def test_the_peers_table_gives_the_default_picks_miss_against_the_fastest_fp32_contender() -> None:
    from benchmarks.peers import markdown, miss, own_gap

    def s(ms: float) -> dict[str, float]:
        return {"median": ms, "q1": ms, "q3": ms}

    row = {"eager": s(20.0), "ORT torchscript": s(10.0), "ORT int8": s(5.0), "aitune default": s(12.0)}
    assert miss(row) == "+20% vs ORT torchscript", "int8 is not an fp32 contender"
    assert miss({**row, "aitune default": s(9.0)}) == "fastest"
    assert miss({**row, "by hand": s(6.0)}, wrong=("by hand",)) == "+20% vs ORT torchscript", "a wrong model is no peer"
    results = {"cases": [{"case": "bert", "contenders": {"ORT torchscript": {}}, "timing_ms": {"1": row},
                          "load_before": (9.5, 9.0, 8.0), "load_after": (9.8, 9.1, 8.1)}]}  # fmt: skip
    text = markdown(results)
    assert text.splitlines()[0].endswith("| default's miss | default vs its own graph |")
    assert "+20% vs ORT torchscript |" in text
    assert "load average (1, 5, 15 min) (9.5, 9.0, 8.0) before timing" in text
    own = {**row, "aitune's graph by hand": s(11.0)}
    assert own_gap(own) == "+9.1%" and own_gap(row) == ""
    assert own_gap({**own, "aitune ORT": s(11.0)}, "aitune ORT") == "+0.0% (aitune ORT)"
    assert miss(own) == "+20% vs ORT torchscript", "aitune's own graph by hand is a reference, not a contender"


def test_the_cold_start_table_gives_each_phase_and_the_first_answer_against_eagers() -> None:
    from benchmarks.cold_start import FULL_GC, table

    def run(answer: float, cpu_answer: float, **phases: float) -> tuple[float, dict]:
        return answer + 0.5, {"answer": answer, "python": 0.02, **phases, "modules": 1000.0, "imported": ["x"],
                              "cpu": {"answer": cpu_answer, "python": 0.01, **phases}}  # fmt: skip

    results = {"runs": {
        "eager": [run(1.0, 0.9, weights=0.02), run(1.2, 1.1, weights=0.02), run(1.1, 1.0, weights=0.02)],
        "ait.load (x)": [run(1.3, 1.2, plugins=0.01, **{FULL_GC: 0.07}) for _ in range(2)]
        + [run(1.2, 1.1, plugins=0.01, **{FULL_GC: 0.0})],
    }}  # fmt: skip
    wall, cpu = table(results).splitlines(), table(results, cpu=True).splitlines()
    assert "| eager | 0.020 |" in wall[2] and "**1.100** (1.000-1.200) | 1.00x | 0.500 |" in wall[2]
    assert "**1.300** (1.200-1.300) | 1.18x |" in wall[3] and "| 0.010 |" in wall[3]
    assert "| ait.load (x) | 0.010 |" in cpu[3] and "**1.200** (1.100-1.200) | 1.20x |" in cpu[3]
    assert wall[0].split(" | ").index(FULL_GC) == wall[3].split(" | ").index("0.070"), "the collections' own column"
    assert "|  | **1.000**" in cpu[2], "no figure for the collections: an empty cell"


def test_the_generation_split_times_each_wrapped_call_and_puts_the_model_back() -> None:
    import torch
    from torch._dynamo.eval_frame import OptimizedModule

    from benchmarks.generation import bound, markdown
    from benchmarks.step_timing import timed

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    inner, call = model[0], OptimizedModule.__call__
    with timed(model, [("0", inner)]) as calls:
        assert model[0].in_features == 4, "attributes read through the timer come from the module"
        model(torch.ones(2, 4))
        model(torch.ones(2, 4))
    assert len(calls.wrapped["0"]) == 2 and all(t > 0 for t in calls.wrapped["0"])
    assert model[0] is inner and OptimizedModule.__call__ is call, "the module and torch's classes are put back"

    def split(token: float, wrapped: float, step: float, **tuned: float) -> dict[str, float]:
        return {"token": token, "wrapped": wrapped, "rest": token - wrapped, "steps per token": 0.5, "step": step,
                **tuned}  # fmt: skip

    tuned = split(2.0, 1.5, 2.0, compiled=1.5, kernels=1.0, **{"compiled calls per step": 1.0,
                  "Inductor calls per step": 1.0})  # fmt: skip
    row = {"batch": 1, "eager, dynamic cache": 100.0, "eager, static cache": 90.0, "tuned, default": 150.0,
           "tuned, static cache": 140.0, "best eager": "eager, dynamic cache",
           "split": {"eager, dynamic cache": split(4.0, 3.0, 5.0), "tuned, default": tuned}}  # fmt: skip
    assert bound(row) == 4.0 / (4.0 - (5.0 - 1.0) * 0.5), "each eager step costing the tuned step's kernels"
    text = markdown({"threads": 1, "repeats": 3, "cpu": "Test CPU", "cases": [
        {"model": "llama", "tune_s": 9.0, "decisions": {"model": ["torch_eager", "torch_inductor_jit"]},
         "rows": [row]}]})  # fmt: skip
    assert "| llama | 1 | 100 | 90 | 150 | 140 | 1.50x / 1.40x |" in text
    assert "| 4.00 = 3.00 + 1.00 (dynamic) | 2.00 = 1.50 + 0.50 | 5.00 | 2.00 = 0.50 + 0.50 + 1.00 " in text
    assert "| 2.00x | 2.00x |" in text and "model: torch_eager, torch_inductor_jit" in text
