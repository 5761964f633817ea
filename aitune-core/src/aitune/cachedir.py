"""The one folder where aitune keeps what outlives a run, and the rules that keep it the user's own.

Its users each keep a subfolder: the build cache of built candidates (``builds/``, see
:mod:`aitune.builtin.buildcache`), the JIT's remembered decisions (see
:mod:`aitune.engine.jit.decision_store`) and the backends' compiler caches (``BuildContext.cache_dir``).

What is in it runs: a cached AOTInductor package is a shared library. So every folder aitune
makes in it is 0700 whatever the umask (:func:`private_folder`), a cache folder another user owns
or others may write is refused, every entry and each folder above it is checked for its owner and
mode before use (an entry that is not the user's alone is removed with a warning:
:func:`checked_entry`), and every entry records the digests of its files, checked before use
(:func:`digests`, :func:`changed`). Digests alone prove nothing against whoever could write the
folder: they can recompute them; owners and modes are what keep their entries out.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import warnings
from pathlib import Path

from .envvars import CACHE_DIR, cache_base
from .errors import ConfigError
from .files import make_folders, uid

_CHUNK = 1 << 20


def cache_dir() -> Path:
    """``AITUNE_CACHE_DIR``, else ``$XDG_CACHE_HOME/aitune``, else ``~/.cache/aitune``; created on use.

    In a job of several ranks each rank gets its own folder inside it (``rank-R-of-W``), so ranks
    never write the same entries at once. Raises :class:`ConfigError` for a folder this user does
    not own or that others can write.
    """
    from .distributed import rank_label

    path = CACHE_DIR.get() or cache_base() / "aitune"
    label = rank_label()
    folders = [path, path / label] if label is not None else [path]
    for folder in folders:
        make_folders(folder, "cache")
        check_private(folder)
    return folders[-1]


def _uid() -> int:
    """The user aitune runs as: whose alone the cache must be."""
    return uid()


def not_private(path: Path) -> str | None:
    """Why ``path`` (not followed if a link) is not the user's alone, or None."""
    if not hasattr(os, "getuid"):  # no POSIX owners (Windows): the folder's ACL decides
        return None
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if info.st_uid != _uid():
        return f"it belongs to user id {info.st_uid}, not to you ({_uid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others may write it (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def check_private(folder: Path) -> None:
    """Refuse a cache folder that another user owns or that group or others may write."""
    problem = not_private(folder)
    if problem:
        raise ConfigError(
            f"the aitune cache {folder} is not yours alone: {problem}. What is cached there runs when it is used, "
            "and whoever could write it may have left entries there (chmod alone keeps them), so aitune refuses it: "
            f"move it away or empty it (mv {folder} {folder}.untrusted; aitune makes a new, private one), or set "
            "AITUNE_CACHE_DIR to a folder of your own"
        )


def private_folder(*parts: str) -> Path:
    """``cache_dir()/parts...``, every missing folder made 0700 whatever the umask (mkdir's mode only
    ever loses bits to it); folders already there are checked where they are used (:func:`checked_entry`)."""
    folder = cache_dir()
    for part in parts:
        folder = folder / part
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
    return folder


def make_private(folder: Path) -> None:
    """Before a staged entry is renamed into the cache: its folders 0700, no file writable by others
    (a backend wrote them under the user's umask, which may be 000)."""
    for path in (folder, *folder.rglob("*")):
        if path.is_symlink():
            continue
        mode = stat.S_IMODE(path.lstat().st_mode)
        path.chmod(0o700 if path.is_dir() else mode & ~(stat.S_IWGRP | stat.S_IWOTH))


def checked_entry(entry: Path) -> bool:
    """Whether the cache entry ``entry``, everything in it and every folder between it and the cache
    are the user's alone. If not, the first folder that is not (with all it holds) is removed with a
    warning, and False returned: the caller builds again."""
    root = cache_dir()
    folder = root
    for part in entry.relative_to(root).parts:
        folder = folder / part
        if not os.path.lexists(folder):
            return True  # nothing there yet: nothing to use
        problem = not_private(folder)
        if problem is None and folder == entry:
            problem = next(filter(None, (_not_private_at(p) for p in entry.rglob("*"))), None)
        if problem:
            warnings.warn(
                f"aitune cache: {folder} is not yours alone ({problem}); what is cached there runs when used, so it "
                "was removed and is built again",
                RuntimeWarning,
                stacklevel=3,
            )
            evict(folder)
            return False
    return True


def _not_private_at(path: Path) -> str | None:
    problem = not_private(path)
    return f"{path.name}: {problem}" if problem else None


def evict(path: Path) -> None:
    """Remove ``path`` from the cache; moved aside first, since what another user owns may not be deletable."""
    aside = path.with_name(f".evicted-{path.name}-{os.getpid()}")
    try:
        os.rename(path, aside)
    except OSError:
        aside = path
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


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
