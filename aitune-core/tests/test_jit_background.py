"""JIT that never stalls a call: modules are tuned on a tuner thread while their calls run eager,
and the winner is installed between two calls once it is proven.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from aitune.engine.recording import bypass
from aitune.testing import assert_matches_eager
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch import FirstWinsStrategy, jit
from aitune.torch.jit import config as jit_config

BUILD_S = 1.5
"""How long the slow toy backend takes to build: far longer than any call."""


class SlowBuildToy(ToyBackend):
    """Correct and fast, but its build takes :data:`BUILD_S`, as a real compiler's does."""

    name = "toy"

    def build(self, module: torch.nn.Module, context: Any) -> None:
        time.sleep(BUILD_S)
        super().build(module, context)


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@pytest.fixture
def background(toy_backends: Any) -> Iterator[None]:
    jit_config.reset()
    strategy = FirstWinsStrategy([SlowBuildToy(ToyConfig())], performance_validation=False)
    with jit_config.patch(strategy=strategy, min_parameters=0, min_samples=3, mode="background", remember=False):
        jit.enable()
        try:
            yield
        finally:
            jit.wait(30)
            jit.disable()
    jit_config.reset()


def test_calls_keep_running_eager_while_the_module_tunes_then_switch(background: None) -> None:
    torch.manual_seed(0)
    model = Encoder().eval()
    latencies, statuses = [], []
    errors: list[BaseException] = []

    def serve() -> None:  # the program's own thread, as a server loop is
        try:
            deadline = time.perf_counter() + 30
            with torch.no_grad():
                while time.perf_counter() < deadline:
                    x = torch.randn(2, 8)
                    start = time.perf_counter()
                    y = model(x)
                    latencies.append(time.perf_counter() - start)
                    with bypass():
                        assert_matches_eager(y, model(x))  # before, during and after the switch
                    statuses.append(jit.status().get("Encoder", ""))
                    if statuses[-1].startswith("tuned") and statuses.count(statuses[-1]) > 3:
                        return
                    time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)

    caller = threading.Thread(target=serve)
    caller.start()
    caller.join(60)
    assert not errors, errors
    assert any(s == "tuning" for s in statuses), "calls ran while the module was being tuned"
    assert statuses[-1] == "tuned: toy", statuses[-1]
    assert max(latencies) < BUILD_S / 3, "no call waited for the build"
    assert isinstance(model.__dict__.get("forward"), jit.TunedForward)
    assert [(d.name, d.outcome) for d in jit.decisions()] == [("Encoder", "tuned")]


def test_status_says_where_each_module_stands(background: None) -> None:
    model = Encoder().eval()
    with torch.no_grad():
        model(torch.randn(2, 8))
        assert jit.status() == {"Encoder": "recording (1 calls)"}
        for _ in range(3):
            model(torch.randn(2, 8))
    assert jit.status()["Encoder"] in ("tuning", "tuned: toy")
    assert jit.wait(30)
    assert jit.status() == {"Encoder": "tuned: toy"}


def test_inline_mode_tunes_inside_the_call(toy_backends: Any) -> None:
    jit_config.reset()
    strategy = FirstWinsStrategy([SlowBuildToy(ToyConfig())], performance_validation=False)
    with jit_config.patch(strategy=strategy, min_parameters=0, min_samples=2, mode="inline", remember=False):
        jit.enable()
        try:
            model = Encoder().eval()
            with torch.no_grad():
                model(torch.randn(2, 8))
                start = time.perf_counter()
                model(torch.randn(2, 8))  # reaches min_samples: tuned inside this call
                assert time.perf_counter() - start >= BUILD_S
            assert jit.status() == {"Encoder": "tuned: toy"}
        finally:
            jit.disable()
    jit_config.reset()


def test_mode_and_share_are_checked_and_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="mode"):
        jit_config.mode = "later"
    with pytest.raises(ValueError, match="max_tuning_share"):
        jit_config.max_tuning_share = 0
    monkeypatch.setenv("AITUNE_JIT_MODE", "INLINE")
    monkeypatch.setenv("AITUNE_JIT_MAX_TUNING_SHARE", "0.25")
    jit_config.reset()
    try:
        assert (jit_config.mode, jit_config.max_tuning_share) == ("inline", 0.25)
    finally:
        monkeypatch.delenv("AITUNE_JIT_MODE")
        monkeypatch.delenv("AITUNE_JIT_MAX_TUNING_SHARE")
        jit_config.reset()
    assert jit_config.mode == "background", "background tuning is the default"


def test_process_exit_waits_for_no_tuning(tmp_path: Any) -> None:
    """A script that ends while its module is still being built (a one-minute build) exits at once,
    cleanly: the unfinished tune is dropped."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "jit_scripts" / "exit_while_tuning.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITUNE_JIT")}
    env["AITUNE_CACHE_DIR"] = str(tmp_path / "cache")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"status": {"Encoder": "tuning"}, "correct": True, "mode": "background"}
    assert took < 45, f"exit waited for the build ({took:.0f} s)"
    assert "tuning Encoder in the background" in done.stderr


@pytest.mark.slow
def test_exit_while_the_tuner_runs_native_code_never_aborts(tmp_path: Any) -> None:
    """Exiting while the tuner times calls (native code, the GIL released) aborted the process in
    about one run of five ("terminate called without an active exception"); exit now stops the tuner
    at its next step first. Five runs, side by side (each exits at its own moment of the tuner's
    work), each must end cleanly."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "jit_scripts" / "exit_while_profiling.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AITUNE_JIT")}
    command = [sys.executable, str(script), "60"]
    runs = [
        subprocess.Popen(
            command,
            env={**env, "AITUNE_CACHE_DIR": str(tmp_path / f"cache{i}")},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(5)
    ]
    for run, process in enumerate(runs):
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0 and "terminate called" not in stderr, (
            f"run {run}: exit code {process.returncode}\n{stderr[-2000:]}"
        )
        assert '"Encoder": "tuning"' in stdout, "the script returned before the tuner started"


def test_the_tuner_shares_the_gil_while_it_runs_and_puts_the_switch_interval_back(background: None) -> None:
    """While a module tunes, a program thread waiting for the GIL gets it back within 1 ms (not the
    interpreter's 5 ms); once the tuner is done, the process's own interval is back."""
    import sys

    from aitune.engine.jit.background import SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    model = Encoder().eval()
    seen: list[float] = []
    with torch.no_grad():
        for _ in range(400):
            model(torch.randn(2, 8))
            if jit.status().get("Encoder") == "tuning":
                seen.append(sys.getswitchinterval())
            if jit.status().get("Encoder", "").startswith("tuned"):
                break
            time.sleep(0.01)
    assert jit.wait(30)
    assert seen and max(seen) <= SWITCH_INTERVAL_S, seen[:5]
    assert sys.getswitchinterval() == before
