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

from aitune.testing.conformance import run_in_fresh_process

PLANTED = """
import json, os, sys
from pathlib import Path

from torch._inductor.runtime.cache_dir_utils import default_cache_dir

DEFAULT = os.path.abspath(default_cache_dir())  # <TMPDIR>/torchinductor_<user>: made first by another account
for sub in ("fxgraph", "aotautograd", "precompiled_headers", "triton/0"):
    (Path(DEFAULT) / sub).mkdir(parents=True, exist_ok=True)
    (Path(DEFAULT) / sub / "planted").write_text("another account's entry")
for path in (Path(DEFAULT), *Path(DEFAULT).rglob("*")):
    path.chmod(0o777 if path.is_dir() else 0o666)  # the victim may write it, as Inductor needs
    if os.getuid() == 0:
        os.chown(path, 65534, 65534)


def snapshot():
    return sorted(
        [str(p.relative_to(DEFAULT)), p.stat().st_size, p.stat().st_mtime_ns] for p in Path(DEFAULT).rglob("*")
    )


BEFORE = snapshot()
TOUCHED = []
WATCHING = [False]
PATH_EVENTS = {"open", "os.listdir", "os.scandir", "os.mkdir", "os.remove", "os.rmdir", "os.chmod",
               "os.truncate", "os.utime", "os.symlink", "os.link", "shutil.copyfile", "shutil.rmtree"}


def ours(path):
    return isinstance(path, (str, bytes, os.PathLike)) and (
        os.path.abspath(os.fsdecode(path)) + os.sep).startswith(DEFAULT + os.sep)


def hook(event, args):
    if not WATCHING[0]:
        return
    if event in PATH_EVENTS and args and ours(args[0]):
        TOUCHED.append([event, os.fsdecode(args[0])])
    elif event == "os.rename" and (ours(args[0]) or ours(args[1])):
        TOUCHED.append([event, os.fsdecode(args[1])])
    elif event == "subprocess.Popen" and DEFAULT in " ".join(map(str, args[1] or ())):  # -include <header>
        TOUCHED.append([event, " ".join(map(str, args[1]))[:300]])


sys.addaudithook(hook)
"""
"""The start of the fresh process: the default folder planted, and an audit hook that records any
opening, listing, making or removing of a file under it (and any compiler command naming it)."""

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
