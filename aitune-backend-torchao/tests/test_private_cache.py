"""A compiled TorchAO payload compiles at load and at new shapes only in aitune's private cache.

TorchAO compiles at load (``compile=True`` is its default). With Inductor's default folder,
``/tmp/torchinductor_<user>``, another account that makes that folder first and puts pickled FX
graphs or AOTAutograd entries (or a precompiled header) in it would have them loaded, and run, by
the victim's next ``ait.load``. The test plants that folder as another account in a fresh process
and records every file operation under it (an audit hook) while the payload loads and runs.
"""

from __future__ import annotations

import os
from pathlib import Path

from aitune_testkit.planted_inductor import PLANTED

from aitune.testing.conformance import run_in_fresh_process

LOAD = """
import torch
from aitune.backend import BuildContext, LoadContext
from aitune.cachedir import cache_dir
from aitune.graph import Sample, infer_graph
from aitune.testing import TinyMLP
from aitune_backend_torchao.backend import TorchAOBackend
from aitune_backend_torchao.config import TorchAOBackendConfig

torch.manual_seed(0)
module = TinyMLP().eval()
samples = [Sample((torch.randn(2, 16),))]  # one batch size: a call at another compiles again
cpu = torch.device("cpu")
with torch.no_grad():
    graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
root = Path(os.environ["AITUNE_CACHE_DIR"]).parent
(root / "work").mkdir()
(root / "payload").mkdir()
saved = TorchAOBackend(TorchAOBackendConfig(quantization="int8dq", compile=False))  # the payload is the same
saved.build(module, BuildContext(graph, samples, cpu, root / "work", cache_dir()))
metadata = saved.save(root / "payload")

private = cache_dir() / "inductor"
COUNTS = {}
ENV_BEFORE = [os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get("TRITON_CACHE_DIR")]
WATCHING[0] = True
loaded = TorchAOBackend(TorchAOBackendConfig(quantization="int8dq"))  # compile=True, torchao's default
loaded.load(module, root / "payload", LoadContext(graph, cpu, metadata, cache_dir()))  # as ait.load does
COUNTS["load"] = sum(1 for _ in private.rglob("*"))
for batch in (3, 5):
    x = torch.randn(batch, 16)
    torch.testing.assert_close(loaded.infer(x), saved.infer(x), rtol=1e-3, atol=1e-3)
WATCHING[0] = False
COUNTS["calls"] = sum(1 for _ in private.rglob("*"))
print(json.dumps({
    "touched": TOUCHED, "before": BEFORE, "after": snapshot(), "default": DEFAULT, "counts": COUNTS,
    "private_mode": oct(private.stat().st_mode & 0o777), "compiled": loaded.build_info["compiled"],
    "env": [ENV_BEFORE, [os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get("TRITON_CACHE_DIR")]],
}))
"""


def test_a_compiled_payload_loads_and_recompiles_only_in_aitunes_cache(tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(TMPDIR=str(tmp_path / "tmp"), AITUNE_CACHE_DIR=str(tmp_path / "aitune"))

    result = run_in_fresh_process(PLANTED + LOAD, env=env)

    assert result["default"].startswith(str(tmp_path)) and result["compiled"] is True
    assert result["touched"] == [], "loading or calling the payload used Inductor's default folder"
    assert result["after"] == result["before"], "something was written to Inductor's default folder"
    assert result["counts"]["load"] > 0, "the load compiled nothing into aitune's cache"
    assert result["counts"]["calls"] > result["counts"]["load"], "calls at new shapes compiled nothing"
    assert result["private_mode"] == "0o700"
    before, after = result["env"]
    assert after == before, "the load or the calls left Inductor's environment changed"
