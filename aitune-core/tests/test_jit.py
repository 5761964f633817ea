"""JIT mode: tuning with no code change, top-down, deferred, and remembered across runs.

Toy backends stand in for compilers: what is checked is the JIT's own logic (what it records,
when it tunes, what it installs and remembers), never speed.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aitune import hookimpl
from aitune.engine.recording import bypass
from aitune.testing import assert_matches_eager
from aitune.torch import FirstWinsStrategy, jit
from aitune.torch.jit import TunedForward
from aitune.torch.jit import config as jit_config
from aitune.torch.jit.tune import deferred

SCRIPTS = Path(__file__).parent / "jit_scripts"
SRC = Path(__file__).parent.parent / "src"


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Branchy(torch.nn.Module):
    """Data-dependent control flow: TorchDynamo cannot capture it as one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return y * 2 if y.sum() > 0 else y - 1


class Builds:
    def __init__(self) -> None:
        self.count = 0

    @hookimpl(wrapper=True)
    def aitune_build(self, backend: Any, module: Any, context: Any) -> Any:
        self.count += 1
        return (yield)


@pytest.fixture
def builds(toy_backends: Any, register_plugin: Any) -> Builds:
    return register_plugin(Builds(), name="build-counter")  # type: ignore[no-any-return]


@pytest.fixture
def jit_on(toy_backends: Any) -> Iterator[None]:
    """JIT tuning on with the toy backend and test-sized thresholds; off and forgotten afterwards."""
    from aitune.testing.backends import ToyBackend

    jit_config.reset()
    strategy = FirstWinsStrategy([ToyBackend()], performance_validation=False)
    # inline: each test checks what became of a module right after the call that tuned it
    with jit_config.patch(strategy=strategy, min_parameters=0, min_samples=2, mode="inline"):
        jit.enable()
        try:
            yield
        finally:
            jit.disable()
    jit_config.reset()


def run_and_compare(model: torch.nn.Module, batches: list[int], features: int = 8) -> None:
    """Call ``model`` like a program would and check every output against its own eager forward."""
    with torch.no_grad():
        for batch in batches:
            x = torch.randn(batch, features)
            y = model(x)
            with bypass():
                expected = model(x)
            assert_matches_eager(y, expected)


def outcomes() -> list[tuple[str, str, bool]]:
    return [(d.name, d.outcome, d.from_cache) for d in jit.decisions()]


# -- in process -------------------------------------------------------------------------------


def test_tunes_a_top_level_module_after_min_samples_and_keeps_its_hooks(jit_on: None) -> None:
    torch.manual_seed(0)
    model = Block().eval()
    seen = []
    model.register_forward_hook(lambda m, a, out: seen.append(out.shape[0]))
    keys = list(model.state_dict())
    run_and_compare(model, [2])
    assert jit.decisions() == []  # one call is not enough
    run_and_compare(model, [3, 2, 3])
    assert outcomes() == [("Block", "tuned", False)]
    assert isinstance(model.__dict__["forward"], TunedForward)
    assert jit.decisions()[0].backends == ("toy",)
    assert list(model.state_dict()) == keys and type(model) is Block
    assert seen == [2, 2, 3, 3, 2, 2, 3, 3]  # the user's hook still runs on every call, tuned or eager
    jit.disable()
    assert "forward" not in model.__dict__


def test_disable_leaves_no_global_hook_behind(jit_on: None) -> None:
    """After disable(), torch.compile in the same process does not warn about global module hooks."""
    jit.disable()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        compiled = torch.compile(torch.nn.Linear(4, 4), backend="eager")
        compiled(torch.randn(2, 4))


def test_graph_break_keeps_parent_eager_and_tunes_child(jit_on: None) -> None:
    torch.manual_seed(0)
    model = Branchy().eval()
    run_and_compare(model, [2, 3])
    assert outcomes() == [("Branchy", "descended", False)]
    assert "Data-dependent" in jit.decisions()[0].reason
    run_and_compare(model, [2, 3, 2])
    assert outcomes() == [("Branchy", "descended", False), ("Branchy.inner", "tuned", False)]
    assert "forward" not in model.__dict__
    assert isinstance(model.inner.__dict__["forward"], TunedForward)


def test_max_depth_zero_stops_at_the_top(jit_on: None) -> None:
    model = Branchy().eval()
    with jit_config.patch(max_depth=0):
        run_and_compare(model, [2, 3, 2, 3])
    assert outcomes() == [("Branchy", "eager", False)]
    assert "max_depth=0" in jit.decisions()[0].reason


def test_deferred_mode_tunes_only_after_deferred(jit_on: None) -> None:
    model = Block().eval()
    with jit_config.patch(deferred=True, min_samples=1):
        run_and_compare(model, [2, 3, 4, 2, 3])
        assert jit.decisions() == []
        deferred()
        assert jit.decisions() == []  # tuning starts at the next forward, not inside deferred()
        run_and_compare(model, [2])
        assert outcomes() == [("Block", "tuned", False)]
        run_and_compare(model, [3, 4])


def test_skips_small_excluded_and_training_modules(jit_on: None, caplog: pytest.LogCaptureFixture) -> None:
    with jit_config.patch(min_parameters=10_000), caplog.at_level(logging.INFO, logger="aitune"):
        run_and_compare(Block().eval(), [2, 3, 2])
    assert "not tuning Block: 72 parameters, fewer than min_parameters=10000" in caplog.text, "said at INFO"
    with jit_config.patch(exclude=("Bl",)), caplog.at_level(logging.INFO, logger="aitune"):
        run_and_compare(Block().eval(), [2, 3, 2])
    assert "excluded by 'Bl'" in caplog.text
    training = Block()
    with caplog.at_level(logging.WARNING, logger="aitune"):
        run_and_compare(training, [2, 3, 2])
    assert jit.decisions() == []
    assert "training mode" in caplog.text


def test_remembered_decision_is_reused_and_invalidated_by_new_weights(jit_on: None, builds: Builds) -> None:
    torch.manual_seed(0)
    model = Block().eval()
    run_and_compare(model, [2, 3, 2])
    assert outcomes() == [("Block", "tuned", False)] and builds.count == 1
    jit.disable()  # a "new run" in this process: everything forgotten but the cache dir
    jit.enable()
    run_and_compare(model, [2, 3, 2])
    assert outcomes() == [("Block", "tuned", True)] and builds.count == 1
    jit.disable()
    with torch.no_grad():
        model.fc.weight.add_(0.5)
    jit.enable()
    run_and_compare(model, [2, 3, 2])
    assert outcomes() == [("Block", "tuned", False)] and builds.count == 2


def test_a_changed_forward_gets_a_new_key_and_is_tuned_again(
    jit_on: None, builds: Builds, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = Block().eval()
    run_and_compare(model, [2, 3, 2])
    jit.disable()
    monkeypatch.setattr(Block, "forward", lambda self, x: torch.tanh(self.fc(x)) * 2.0)
    jit.enable()
    run_and_compare(model, [2, 3, 2])
    assert outcomes() == [("Block", "tuned", False)] and builds.count == 2


def test_a_remembered_winner_that_disagrees_with_eager_is_dropped_and_tuned_again(
    jit_on: None, builds: Builds, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Code the key cannot see (a helper outside the class) can still make a remembered payload stale."""
    from aitune.testing.backends import ToyBackend

    torch.manual_seed(0)
    model = Block().eval()
    run_and_compare(model, [2, 3, 2])
    jit.disable()
    load = ToyBackend.load

    def stale_load(self: ToyBackend, *args: Any, **kwargs: Any) -> None:
        load(self, *args, **kwargs)
        self.transform = lambda output, args: output * 2  # type: ignore[method-assign]

    monkeypatch.setattr(ToyBackend, "load", stale_load)
    monkeypatch.setenv("AITUNE_BUILD_CACHE", "0")  # the stale payload is the JIT's remembered one only
    jit.enable()
    with caplog.at_level(logging.WARNING, logger="aitune"):
        run_and_compare(model, [2, 3, 2])
    assert outcomes() == [("Block", "tuned", False)] and builds.count == 2
    assert "no longer matches the module" in caplog.text
    monkeypatch.setattr(ToyBackend, "load", load)
    jit.disable()
    jit.enable()
    run_and_compare(model, [2, 3, 2])  # the entry written by the new tuning is the one reused
    assert outcomes() == [("Block", "tuned", True)] and builds.count == 2


def test_graph_break_decision_is_remembered(jit_on: None, builds: Builds) -> None:
    model = Branchy().eval()
    run_and_compare(model, [2, 3, 2, 3])
    assert outcomes() == [("Branchy", "descended", False), ("Branchy.inner", "tuned", False)]
    jit.disable()
    jit.enable()
    run_and_compare(model, [2, 3, 2, 3])
    assert outcomes() == [("Branchy", "descended", True), ("Branchy.inner", "tuned", True)]
    assert builds.count == 1


def test_config_checks_values_and_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="min_samples"):
        jit_config.min_samples = 0
    with pytest.raises(AttributeError, match="no setting 'min_sample'"):
        jit_config.min_sample = 3  # type: ignore[attr-defined]
    monkeypatch.setenv("AITUNE_JIT_MIN_SAMPLES", "7")
    monkeypatch.setenv("AITUNE_JIT_EXCLUDE", "Dropout, mypkg.")
    monkeypatch.setenv("AITUNE_JIT_DEFERRED", "1")
    try:
        jit_config.reset()
        assert (jit_config.min_samples, jit_config.exclude, jit_config.deferred) == (7, ("Dropout", "mypkg."), True)
    finally:
        monkeypatch.delenv("AITUNE_JIT_MIN_SAMPLES")
        monkeypatch.delenv("AITUNE_JIT_EXCLUDE")
        monkeypatch.delenv("AITUNE_JIT_DEFERRED")
        jit_config.reset()


def test_deferred_without_jit_does_nothing() -> None:
    assert not jit.enabled()
    deferred()
    assert jit.decisions() == []


# -- in a fresh interpreter -------------------------------------------------------------------


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITUNE_JIT")}
    env.update(AITUNE_CACHE_DIR=str(cache), AITUNE_JIT_MODE="inline", **extra)  # the scripts count calls routed
    return env


def _run(args: list[str], env: dict[str, str]) -> tuple[dict[str, Any], str]:
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_second_run_reuses_the_first_runs_decision_without_building(tmp_path: Path) -> None:
    env = _env(tmp_path / "cache")
    first, first_log = _run([str(SCRIPTS / "with_import.py")], env)
    assert [(d["name"], d["outcome"], d["from_cache"]) for d in first["decisions"]] == [("Encoder", "tuned", False)]
    assert first["builds"] == 1 and first["matches"]
    assert "reusing" not in first_log

    second, second_log = _run([str(SCRIPTS / "with_import.py")], env)
    assert [(d["name"], d["outcome"], d["from_cache"]) for d in second["decisions"]] == [("Encoder", "tuned", True)]
    assert second["builds"] == 0 and second["matches"]
    # the remembered winner is first validated (2 recorded calls, then the batch range's min and max),
    # then the three calls after min_samples=2 run it
    assert second["routed"] == 4 + 3
    lines = [line for line in second_log.splitlines() if "aitune jit:" in line]
    assert lines == ["aitune: aitune jit: reusing tuned Encoder (toy) from cache"]


def test_aitune_jit_env_var_turns_jit_on_through_the_installed_pth(tmp_path: Path) -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    if not (site / "aitune_jit.pth").is_file():
        pytest.skip(
            "aitune-core was installed before it shipped aitune_jit.pth; reinstall it (pip install -e aitune-core)"
        )
    report, _ = _run([str(SCRIPTS / "no_import.py")], _env(tmp_path, AITUNE_JIT="1"))
    assert report["enabled"] and [d["outcome"] for d in report["decisions"]] == ["tuned"] and report["matches"]
    report, _ = _run([str(SCRIPTS / "no_import.py")], _env(tmp_path / "other"))
    assert not report["enabled"] and report["decisions"] == []


def test_shipped_pth_line_runs_the_hook(tmp_path: Path) -> None:
    """The .pth as shipped, processed by ``site`` from a fresh site dir; ``-S`` keeps the installed copy out."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "aitune_jit.pth").write_text((SRC / "aitune_jit.pth").read_text())
    code = "import site, sys; site.addsitedir(sys.argv[1]); import aitune.torch.jit as jit; print(jit.enabled())"
    for flag, expected in (("1", "True"), ("0", "False"), ("", "False")):
        env = {k: v for k, v in os.environ.items() if k != "AITUNE_JIT"}
        env["AITUNE_JIT"] = flag
        env["PYTHONPATH"] = os.pathsep.join([str(SRC), sysconfig.get_paths()["purelib"]])
        done = subprocess.run(
            [sys.executable, "-S", "-c", code, str(site_dir)], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == expected


def test_hook_imports_nothing_when_aitune_jit_is_unset() -> None:
    env = {k: v for k, v in os.environ.items() if k != "AITUNE_JIT"}
    code = (
        "import sys, _aitune_jit_hook; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'aitune')))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_tampered_remembered_decision_is_forgotten_and_tuned_again(
    jit_on: None, builds: Builds, _isolated_cache: Path
) -> None:
    """The JIT store is read as data: changed payload files, or a payload path outside the entry,
    and the decision is dropped (never loaded) and the module tuned again."""
    torch.manual_seed(0)
    model = Block().eval()
    run_and_compare(model, [2, 3, 2])
    [decision] = (_isolated_cache / "jit").rglob("decision.json")
    [payload] = decision.parent.rglob("toy.txt")
    payload.write_text("0.0 ")  # someone changed the stored payload
    jit.disable()
    jit.enable()
    run_and_compare(model, [2, 3, 2])
    assert outcomes() == [("Block", "tuned", False)] and builds.count == 2

    [decision] = (_isolated_cache / "jit").rglob("decision.json")
    record = json.loads(decision.read_text())
    record["graphs"][0]["payload"] = str(decision.parent / "0")  # absolute: outside the entry's own names
    decision.write_text(json.dumps(record))
    jit.disable()
    jit.enable()
    run_and_compare(model, [2, 3, 2])
    assert outcomes() == [("Block", "tuned", False)] and builds.count == 3


def test_a_remembered_decision_others_may_write_is_removed_and_tuned_again(
    jit_on: None, builds: Builds, _isolated_cache: Path
) -> None:
    """A JIT store entry is checked for its owner and mode before it is read: one that others may
    write (planted while the cache was shared, its digests recomputed) is removed with a warning."""
    if not hasattr(os, "getuid"):
        pytest.skip("POSIX modes only")
    torch.manual_seed(0)
    model = Block().eval()
    run_and_compare(model, [2, 3, 2])
    [decision] = (_isolated_cache / "jit").rglob("decision.json")
    decision.parent.chmod(0o777)
    jit.disable()
    jit.enable()
    with pytest.warns(RuntimeWarning, match="not yours alone"):
        run_and_compare(model, [2, 3, 2])
    assert outcomes() == [("Block", "tuned", False)] and builds.count == 2, "the entry was used"
    [decision] = (_isolated_cache / "jit").rglob("decision.json")
    assert decision.parent.stat().st_mode & 0o777 == 0o700


class Accumulate(torch.nn.Module):
    """Adds its output into a tensor the caller passes by keyword: a graph that updates an input in
    place, as a KV cache's decode step does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, total: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        total.add_(y)
        return y


def test_a_graph_that_updates_an_input_goes_to_backends_that_write_it_back(jit_on: None, builds: Builds) -> None:
    """The JIT's hooks see a call after it ran; the input it updates in place (here a keyword
    argument) is still found, so a backend that would not write it back is never built for it, and
    the decision is keyed by it: a remembered one is reused and the caller's tensor stays updated."""
    from aitune.engine.jit import decision_store

    torch.manual_seed(0)
    model = Accumulate().eval()

    def calls() -> None:
        with torch.no_grad():
            for batch in (2, 3, 2, 3):
                x, total = torch.randn(batch, 8), torch.randn(batch, 8)
                expected_total = total.clone()
                with bypass():
                    expected = model(x, total=expected_total)
                assert_matches_eager(model(x, total=total), expected)
                assert_matches_eager(total, expected_total)

    keys: list[tuple[str, str]] = []
    real_key = decision_store.decision_key

    def spy(run: Any, module: Any, graphs: Any, strategy: str) -> str:
        import attrs

        key = real_key(run, module, graphs, strategy)
        if [g.mutated for g in graphs] == [("total",)]:
            keys.append((key, real_key(run, module, [attrs.evolve(g, mutated=()) for g in graphs], strategy)))
        return key

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decision_store, "decision_key", spy)
        calls()
        decision = jit.decisions()[0]
        assert (decision.name, decision.outcome) == ("Accumulate", "descended")
        assert "updates inputs in place (total, as" in decision.reason
        # the one build is its child's, which updates nothing
        assert outcomes()[1:] == [("Accumulate.fc", "tuned", False)] and builds.count == 1
        jit.disable()
        jit.enable()
        calls()
        assert outcomes() == [("Accumulate", "descended", True), ("Accumulate.fc", "tuned", True)]
        assert builds.count == 1, "both reused: the key is the same in a new run"
    assert len(keys) == 2 and keys[0] == keys[1] and keys[0][0] != keys[0][1], "the updated input is in the key"
