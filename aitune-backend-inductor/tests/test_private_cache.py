"""Every Inductor compile aitune causes uses aitune's private cache, never Inductor's default folder.

Inductor's default folder, ``/tmp/torchinductor_<user>``, has a name anyone can predict in a folder
anyone can write: another account that makes it first and puts pickled FX graphs, AOTAutograd
entries or a precompiled header there has them loaded by the victim's next compile. These tests
plant that folder as another account and watch every file operation of aitune's calls (an audit
hook in a fresh process): a build, a load, and calls at new shapes, which compile again at run time.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from aitune_testkit.planted_inductor import PLANTED

from aitune.compile_cache import ENV, TRITON_ENV, InductorCacheSwitch, default_dir, inductor_cache, inductor_options
from aitune.testing.conformance import run_in_fresh_process

REPORT = """
private = Path(os.environ["AITUNE_CACHE_DIR"]) / "inductor"
print(json.dumps({
    "touched": TOUCHED, "before": BEFORE, "after": snapshot(), "default": DEFAULT, "counts": COUNTS,
    "private_mode": oct(private.stat().st_mode & 0o777),
    "env": [ENV_BEFORE, [os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get("TRITON_CACHE_DIR")]],
}))
"""

JIT = """
import torch
from aitune.backend import BuildContext
from aitune.cachedir import cache_dir
from aitune.graph import Sample, infer_graph
from aitune.testing import TinyMLP
from aitune_backend_inductor.jit import TorchInductorJitBackend

torch.manual_seed(0)
module = TinyMLP().eval()
samples = [Sample((torch.randn(2, 16),))]  # one batch size: compiled static, so a new one compiles again
with torch.no_grad():
    graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
work = Path(os.environ["AITUNE_CACHE_DIR"]).parent / "work"
work.mkdir()
backend = TorchInductorJitBackend()
private = cache_dir() / "inductor"
COUNTS = {}
ENV_BEFORE = [os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get("TRITON_CACHE_DIR")]
WATCHING[0] = True
backend.build(module, BuildContext(graph, samples, torch.device("cpu"), work, cache_dir()))
COUNTS["build"] = sum(1 for _ in private.rglob("*"))
for batch in (3, 5):
    x = torch.randn(batch, 16)
    with torch.no_grad():
        torch.testing.assert_close(backend.infer(x), module(x))
WATCHING[0] = False
COUNTS["calls"] = sum(1 for _ in private.rglob("*"))
"""


def fresh_env(tmp_path: Path) -> dict[str, str]:
    """A process whose temporary folder (so Inductor's default folder) and aitune cache are ``tmp_path``'s,
    with no cache folder of the user's own chosen."""
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in (ENV, TRITON_ENV)}
    env.update(TMPDIR=str(tmp_path / "tmp"), AITUNE_CACHE_DIR=str(tmp_path / "aitune"))
    return env


def assert_default_folder_untouched(result: dict) -> None:
    assert result["touched"] == [], "aitune's calls used Inductor's default folder"
    assert result["after"] == result["before"], "something was written to Inductor's default folder"
    assert result["private_mode"] == "0o700"
    before, after = result["env"]
    assert after == before, "aitune's calls left Inductor's environment changed"


def test_jit_builds_and_recompiles_at_new_shapes_only_in_aitunes_cache(tmp_path: Path) -> None:
    result = run_in_fresh_process(PLANTED + JIT + REPORT, env=fresh_env(tmp_path))
    assert result["default"].startswith(str(tmp_path))
    assert_default_folder_untouched(result)
    assert result["counts"]["build"] > 0, "the build wrote nothing to aitune's cache"
    assert result["counts"]["calls"] > result["counts"]["build"], "calls at new shapes compiled nothing"


# -- the switch itself ----------------------------------------------------------------------------


@pytest.fixture
def no_users_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(TRITON_ENV, raising=False)


@pytest.mark.usefixtures("no_users_choice")
def test_overlapping_calls_in_two_threads_keep_the_switch_until_the_last_ends(tmp_path: Path) -> None:
    """A serving thread's call ends while a tuning thread still compiles: the switch holds for the latter."""
    switch = InductorCacheSwitch(tmp_path)
    entered, release = threading.Event(), threading.Event()
    seen = []

    def tuning() -> None:
        with switch:
            entered.set()
            release.wait(10)
            seen.append(os.environ.get(ENV))

    thread = threading.Thread(target=tuning)
    with switch:
        thread.start()
        assert entered.wait(10)
    assert os.environ.get(ENV) == str(tmp_path), "the first call to end took the switch from the other"
    release.set()
    thread.join(10)
    assert seen == [str(tmp_path)]
    assert ENV not in os.environ and TRITON_ENV not in os.environ


def test_the_defaults_inductor_wrote_are_replaced_and_the_users_own_kept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    triton_default = os.path.join(default_dir(), "triton", "0")
    monkeypatch.setenv(ENV, default_dir())  # what Inductor writes there at its first compile
    monkeypatch.setenv(TRITON_ENV, triton_default)  # and at its first Triton kernel
    with inductor_cache(tmp_path) as folder:
        assert folder == tmp_path / "inductor"
        assert os.environ[ENV] == str(folder) and os.environ[TRITON_ENV] == str(folder / "triton" / "0")
    assert os.environ[ENV] == default_dir() and os.environ[TRITON_ENV] == triton_default

    monkeypatch.setenv(ENV, str(tmp_path / "mine"))
    monkeypatch.setenv(TRITON_ENV, str(tmp_path / "my-triton"))
    with inductor_cache(tmp_path) as folder:
        assert folder == tmp_path / "mine"
        assert os.environ[ENV] == str(tmp_path / "mine") and os.environ[TRITON_ENV] == str(tmp_path / "my-triton")


@pytest.mark.usefixtures("no_users_choice")
def test_a_value_set_during_the_switch_is_kept(tmp_path: Path) -> None:
    with InductorCacheSwitch(tmp_path):
        os.environ[ENV] = str(tmp_path / "set-meanwhile")
    assert os.environ[ENV] == str(tmp_path / "set-meanwhile")


@pytest.mark.usefixtures("no_users_choice")
def test_inside_a_switch_the_users_choice_is_what_it_was(tmp_path: Path) -> None:
    """A build that starts while a call holds the switch finds aitune's folder, not a user's choice."""
    from aitune.compile_cache import inductor_cache_dir

    with InductorCacheSwitch(tmp_path / "other" / "inductor"):
        assert inductor_cache_dir(tmp_path) == tmp_path / "inductor"


def test_every_compile_gets_precompiled_headers_off_and_modes_become_options() -> None:
    options = inductor_options({"epilogue_fusion": False}, mode="max-autotune", dynamic=None)
    assert options["cpp_cache_precompile_headers"] is False
    assert options["aot_inductor.precompile_headers"] is False
    assert options["max_autotune"] is True and options["epilogue_fusion"] is False
    assert inductor_options({"cpp_cache_precompile_headers": True})["cpp_cache_precompile_headers"] is False


@pytest.mark.usefixtures("no_users_choice")
def test_the_switch_around_a_call_costs_microseconds(tmp_path: Path) -> None:
    switch = InductorCacheSwitch(tmp_path)
    n = 20000
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            with switch:
                pass
        best = min(best, (time.perf_counter() - start) / n)
    assert best < 50e-6, f"{best * 1e6:.1f} us per call"
