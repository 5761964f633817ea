"""Two ranks started by torchrun (gloo, CPU) tune together: one decision, collective failure, no hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aitune import distributed
from aitune.errors import ConfigError

SCRIPT = Path(__file__).parent / "distributed_scripts" / "two_ranks.py"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    cache = out / "cache"
    env = {**os.environ, "AITUNE_CACHE_DIR": str(cache), "AITUNE_DISTRIBUTED_TIMEOUT_S": "90", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(SCRIPT),
        str(out),
    ]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the ranks hung: torchrun did not finish within 300 s\n{exc.stdout}\n{exc.stderr}")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out, cache, [json.loads((out / f"outcome-{r}.json").read_text()) for r in range(2)]


def test_ranks_install_the_same_winners_and_keep_their_own_cache_and_report(outcomes):
    out, cache, (zero, one) = outcomes
    assert zero["decisions"] == one["decisions"] and zero["installed"] == one["installed"]
    assert zero["routes"][1] and zero["routes"] == one["routes"], "the head's per-batch-range routes are rank 0's too"
    assert all(zero["installed"]), "rank 0 chose a backend for every module"
    assert one["distributed"] == {"rank": 1, "world_size": 2, "decided_by": 0}
    assert one["winner_validated_here"], "rank 1 checked rank 0's winners against its own eager module"
    assert (out / "tune.rank-0-of-2.json").is_file() and (out / "tune.rank-1-of-2.json").is_file()
    assert {p.name for p in cache.iterdir()} >= {"rank-0-of-2", "rank-1-of-2"}


def test_the_artifact_rank_0_saved_loads_on_both_ranks(outcomes):
    _, _, (zero, one) = outcomes
    assert zero["loaded"] == one["loaded"] == zero["installed"]


def test_ranks_that_recorded_different_shapes_both_refuse(outcomes):
    _, _, (zero, one) = outcomes
    for outcome in (zero, one):
        assert outcome["mismatch"].startswith("RankMismatchError: rank 1 would tune something other than rank 0")
        assert "graph.dims.batch.max is '4' on rank 0 and '6' on rank 1" in outcome["mismatch"]


def test_a_build_failure_on_one_rank_fails_both_with_its_error(outcomes):
    _, _, (zero, one) = outcomes
    for outcome in (zero, one):
        assert outcome["injected"].startswith("DistributedTuneError: ait.tune failed on rank 1 of 2")
        assert "injected build failure on rank 1" in outcome["injected"]
        assert outcome["states_after_failure"] == ["passthrough", "passthrough"], "every rank runs eager after it"


def test_with_rank_decision_slowest_the_slowest_ranks_figures_decide_on_every_rank(outcomes):
    _, _, (zero, one) = outcomes
    # the candidate that drops the sleep is fastest on rank 0 but 10 ms slower per call on rank 1
    assert zero["slowest"]["installed"] == one["slowest"]["installed"] == ["toy:0.5"]
    assert zero["slowest"]["decided_by"] == one["slowest"]["decided_by"] == "slowest"
    assert zero["slowest"]["p50"] == one["slowest"]["p50"], "every rank reports the same, exchanged figures"
    assert min(zero["slowest"]["p50"]["0.0"]) >= 10.0, "rank 1's figure counted for the candidate slow there"
    for outcome in (zero, one):  # paired with rank 1's own eager: slower than eager there, whatever rank 0 saw
        assert outcome["slowest"]["speedup"]["0.0"] < 1.0 < outcome["slowest"]["speedup"]["0.5"]


def test_with_rank_decision_slowest_a_candidate_correct_on_one_rank_only_fails_both(outcomes):
    _, _, (zero, one) = outcomes
    for outcome in (zero, one):
        error = outcome["diverged"]
        assert error.startswith("DistributedTuneError: the ranks went different ways"), error
        assert "profile torch_eager, toy, toy at batch 2 while rank 1 was single: profile torch_eager, toy at" in error
        assert "every rank must build and validate the same candidates" in error
        assert outcome["state_after_divergence"] == "passthrough", "the module runs eager on every rank"
        # rank 1 had nothing to time and reached the end while rank 0 was profiling
        assert outcome["nothing_to_time"].startswith("DistributedTuneError: the ranks went different ways")
        assert "while rank 1 was tuning on every rank" in outcome["nothing_to_time"]


def test_every_rank_serves_a_static_route_with_its_own_build_for_that_size(outcomes):
    _, _, (zero, one) = outcomes
    static = [route for route in zero["static"]["routes"] if route[1]]
    assert static == [["toy_faster_static", True, 2, 2], ["toy_faster_static", True, 4, 4]], zero["static"]
    assert one["static"]["routes"] == zero["static"]["routes"]
    # one build per static route, pinned to its size, then the dynamic build of the whole range
    assert zero["static"]["pinned"] == one["static"]["pinned"] == [2, 4, None]
    assert all(one["static"]["validated_here"]), "rank 1 checked each build against its own eager module"


def test_rank_decision_is_checked(monkeypatch):
    assert distributed.rank_decision() == "rank0"
    monkeypatch.setenv("AITUNE_RANK_DECISION", "Slowest")
    assert distributed.rank_decision() == "slowest"
    assert distributed.rank_decision("rank0") == "rank0", "the argument wins over the variable"
    with pytest.raises(ConfigError, match="not one of rank0, slowest"):
        distributed.rank_decision("fastest")


def test_without_a_process_group_ranks_only_keep_their_own_folders(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("AITUNE_CACHE_DIR", str(tmp_path))
    from aitune.cachedir import cache_dir

    assert cache_dir() == tmp_path / "rank-1-of-4"
    assert distributed.per_rank_path("out/tune.json") == Path("out/tune.rank-1-of-4.json")
    monkeypatch.setattr(distributed, "_warned", False)
    with pytest.warns(RuntimeWarning, match="torch.distributed is not initialized"):
        assert distributed.coordinator() is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.rank_label() is None and distributed.per_rank_path("t.json") == Path("t.json")


def test_coordination_can_be_turned_off_for_applications_that_tune_on_one_rank(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("AITUNE_DISTRIBUTED", "off")
    assert distributed.coordinator() is None  # no warning either: the application chose it
    assert distributed.rank_label() == "rank-0-of-2", "the folders stay per rank"
    monkeypatch.setenv("AITUNE_DISTRIBUTED", "maybe")
    with pytest.raises(ConfigError, match="AITUNE_DISTRIBUTED='maybe' is not one of auto, off"):
        distributed.coordinator()
