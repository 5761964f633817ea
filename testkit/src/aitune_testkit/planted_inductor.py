"""Inductor's default cache folder planted as another account would plant it, for the tests that
check every Inductor compile aitune causes stays out of it (aitune-backend-inductor and
aitune-backend-torchao): code to run at the start of a fresh process."""

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
"""The start of a fresh process: the default folder planted, and an audit hook that records any
opening, listing, making or removing of a file under it (and any compiler command naming it)."""
