"""Background JIT tuning never makes a serving call wait on an import (issue 50).

A module imported for the first time by the tuner thread stalls the program's calls (its import
lock; the GIL while a C extension initializes). Switching background tuning on imports what the
tuning will need first. Structure, not timing: in a fresh process the program's thread imports
nothing while the tuner runs, and the tuner thread imports nothing either (ONNX Runtime: export,
build, validation, profiling, install).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("onnxruntime")

SCRIPT = textwrap.dedent(
    """
    import json, sys, threading, time
    import torch
    import aitune.torch.jit as jit
    jit.enable()

    main = threading.get_ident()
    seen = {"serving": [], "tuner": []}
    armed = []

    def audit(event, args):
        if event == "import" and armed:
            seen["serving" if threading.get_ident() == main else "tuner"].append(args[0])

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).eval()
    x = torch.randn(4, 16)
    with torch.inference_mode():
        model(x)
        sys.addaudithook(audit)
        armed.append(True)
        for _ in range(200):
            model(x)
            if jit.status().get("Sequential", "").startswith(("tuned", "eager")):
                break
            time.sleep(0.02)
        jit.wait()
        model(x)
    armed.clear()
    preloaded = jit.startup()
    print(json.dumps({
        "status": jit.status(),
        "serving": sorted(set(seen["serving"])),
        "tuner": sorted(set(seen["tuner"])),
        "preloaded": preloaded.modules if preloaded else None,
    }))
    """
)


def _run(tmp_path, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AITUNE_JIT")}
    environment.update(
        AITUNE_CACHE_DIR=str(tmp_path / "cache"),
        AITUNE_JIT_BACKENDS="onnxruntime",
        AITUNE_JIT_MIN_PARAMETERS="0",
        AITUNE_JIT_REMEMBER="0",
        OMP_NUM_THREADS="1",
        **env,
    )
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.busy
def test_neither_thread_imports_anything_while_the_jit_tunes_in_the_background(tmp_path):
    result = _run(tmp_path)
    assert result["status"] == {"Sequential": "tuned: onnxruntime"}, result["status"]
    assert result["preloaded"], "switching background tuning on imported nothing"
    assert result["serving"] == [], f"the program's thread imported while the JIT tuned: {result['serving']}"
    assert result["tuner"] == [], f"the tuner thread imported while the program served: {result['tuner'][:20]}"


def test_with_preload_off_the_tuner_thread_imports_what_it_needs(tmp_path):
    """The check above can fail: without the preload, the tuner thread imports the exporter and the runtime."""
    result = _run(tmp_path, AITUNE_JIT_PRELOAD="0")
    assert result["status"] == {"Sequential": "tuned: onnxruntime"}, result["status"]
    assert result["preloaded"] is None
    assert "onnxruntime" in result["tuner"]
