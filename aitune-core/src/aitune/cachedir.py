"""The one folder where aitune keeps what outlives a run, and the rules that keep it the user's own.

Its users each keep a subfolder: the build cache of built candidates (``builds/``, see
:mod:`aitune.builtin.buildcache`), the JIT's remembered decisions (see
:mod:`aitune.engine.jit.decision_store`) and the backends' compiler caches (``BuildContext.cache_dir``).

What is in it runs: a cached AOTInductor package is a shared library. So the folder is created
0700, a folder another user owns or others may write is refused, and every entry records the
digests of its files, checked before use (:func:`digests`, :func:`changed`).
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from .errors import ConfigError

_CHUNK = 1 << 20


def cache_dir() -> Path:
    """``AITUNE_CACHE_DIR``, else ``$XDG_CACHE_HOME/aitune``, else ``~/.cache/aitune``; created on use.

    In a job of several ranks each rank gets its own folder inside it (``rank-R-of-W``), so ranks
    never write the same entries at once. Raises :class:`ConfigError` for a folder this user does
    not own or that others can write.
    """
    from .distributed import rank_label

    explicit = os.environ.get("AITUNE_CACHE_DIR")
    if explicit:
        path = Path(explicit)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(base) / "aitune"
    label = rank_label()
    folders = [path, path / label] if label is not None else [path]
    for folder in folders:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private(folder)
    return folders[-1]


def check_private(folder: Path) -> None:
    """Refuse a cache folder that another user owns or that group or others may write."""
    if not hasattr(os, "getuid"):  # no POSIX owners (Windows): the folder's ACL decides
        return
    info = folder.stat()
    problem = None
    if info.st_uid != os.getuid():
        problem = f"it belongs to user id {info.st_uid}, not to you ({os.getuid()})"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"others may write it (mode {stat.S_IMODE(info.st_mode):o})"
    if problem:
        raise ConfigError(
            f"the aitune cache {folder} is not yours alone: {problem}. What is cached there runs when it is used, "
            f"so aitune refuses it: run chmod 700 {folder} if it is yours, or set AITUNE_CACHE_DIR to a folder of "
            "your own"
        )


def digests(folder: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` (but ``exclude``), by its path relative to it."""
    out = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder)).replace("\\", "/")
        if path.is_file() and name not in exclude:
            out[name] = file_sha256(path)
    return out


def changed(folder: Path, expected: object, exclude: tuple[str, ...] = ()) -> str | None:
    """Why ``folder`` no longer holds exactly the files ``expected`` lists with their digests, or None."""
    if not isinstance(expected, dict):
        return "it records no digests of its files"
    found = digests(folder, exclude)
    if set(found) != set(expected):
        return f"its files changed (now {sorted(found)[:5]}, recorded {sorted(map(str, expected))[:5]})"
    for name, digest in found.items():
        if expected[name] != digest:
            return f"{name} does not match its recorded SHA-256"
    return None


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in blocks (a payload can be larger than memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()
