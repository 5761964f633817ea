"""Files and folders aitune makes for the user, the same whatever the umask.

Under umask 000 ``mkdir -p`` makes every parent 0777 and ``open(..., "w")`` a 0666 file, and another
account could then put its own folder in the path or rewrite the file in place. So every folder
aitune makes is 0700, a missing parent is made only inside a folder of the user's own, an existing
folder above that another account owns draws a warning, and every file aitune writes is 0644 at most.
A process's private folders for payload files (:func:`owned_folder`) are reclaimed by the next
process when it dies without removing them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
import weakref
from pathlib import Path

from .errors import ConfigError

try:
    import fcntl
except ImportError:  # Windows: no flock, so owned folders are not reclaimed there
    fcntl = None  # type: ignore[assignment]


def uid() -> int:
    """The user aitune runs as: whose alone its folders must be."""
    return os.getuid()


def make_folders(folder: Path, what: str) -> None:
    """``folder`` and its missing parents, each made 0700 whatever the umask (``mkdir -p`` would make
    the parents 0777 under umask 000). A missing parent is made only inside a folder of this user's:
    in one another account owns, aitune refuses rather than leave a folder there that leads to its
    files. An existing folder above it that another account owns (not root) could be renamed under
    aitune's feet, so it draws a warning (the owner and mode checks below it still hold)."""
    folder = Path(os.path.abspath(folder))
    missing = []
    existing = folder
    while not os.path.lexists(existing) and existing != existing.parent:
        missing.append(existing)
        existing = existing.parent
    _warn_foreign_parents(existing if missing else folder.parent, what)  # the folder itself is checked by its user
    if len(missing) > 1 and hasattr(os, "getuid") and os.stat(existing).st_uid != uid():
        raise ConfigError(
            f"the aitune {what} folder {folder} does not exist and its parent {missing[-1]} would be made inside "
            f"{existing}, which belongs to another account; create {missing[-2].parent} yourself (mode 700), or "
            f"choose a {what} folder under one of your own"
        )
    for part in reversed(missing):
        with contextlib.suppress(FileExistsError):
            part.mkdir(mode=0o700)


def write_file(path: Path, data: str | bytes) -> Path:
    """Write a file aitune makes for the user (a report, a journal line's file) beside its target and
    rename it into place: 0644 at most whatever the umask, missing folders made by :func:`make_folders`."""
    path = Path(path)
    make_folders(path.parent, "output")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data.encode("utf-8") if isinstance(data, str) else data)
    os.replace(tmp, path)
    return path


def _warn_foreign_parents(folder: Path, what: str) -> None:
    """Warn when a folder at or above ``folder`` belongs to another account than this user or root:
    its owner can rename what is in it (Python's default filter shows it once per folder)."""
    if not hasattr(os, "getuid"):
        return
    for parent in (folder, *folder.parents):
        try:
            owner = os.stat(parent).st_uid
        except OSError:
            continue
        if owner in (uid(), 0):
            continue
        warnings.warn(
            f"the aitune {what} folder lies inside {parent}, which belongs to user id {owner}, not to you ({uid()}): "
            f"that account can move aitune's folders away and put its own in their place; set AITUNE_CACHE_DIR and "
            "AITUNE_CONFIG_DIR to folders under one of your own",
            RuntimeWarning,
            stacklevel=4,
        )
        return


OWNER_FILE = ".aitune-owner"
"""The file inside an :func:`owned_folder` that its process holds an exclusive lock on while it lives."""
_RECLAIMED: set[str] = set()  # prefixes this process has looked for dead owners' folders under


def owned_folder(prefix: str, owner: object) -> Path:
    """A private folder (0700) in the temporary folder for ``owner``'s files (a backend's payload
    opened by its runtime), removed when ``owner`` is garbage collected or the process exits.

    A process killed outright (SIGKILL, the OOM killer, Ray stopping a replica) runs neither, and a
    server restarted that way would leave a payload copy behind each time. So the process holds an
    exclusive ``flock`` on a file inside while the folder is in use (the kernel lets it go when the
    process dies, whatever its death), and the first ``owned_folder`` of a prefix in each process
    removes this user's folders of that prefix whose lock it can take: their owner is gone.
    """
    _reclaim(prefix)
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    fd = _lock_owner(folder)
    weakref.finalize(owner, _release, str(folder), fd)
    return folder


def _lock_owner(folder: Path) -> int | None:
    """Lock a new owner file in ``folder``; it gets its final name only once locked, so another process
    never finds it unlocked while this one lives. None where the platform has no ``flock``."""
    if fcntl is None:
        return None
    staging = folder / f"{OWNER_FILE}.new"
    fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.replace(staging, folder / OWNER_FILE)
    return fd


def _release(folder: str, fd: int | None) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    if fd is not None:
        os.close(fd)


def _reclaim(prefix: str) -> None:
    """Remove this user's folders named ``prefix*`` in the temporary folder whose owner file is not
    locked (their process died); once per prefix and process. Folders without an owner file (another
    aitune's, or one being made) and anything not a plain folder of this user's are left alone."""
    if prefix in _RECLAIMED:
        return
    _RECLAIMED.add(prefix)
    if fcntl is None:
        return
    root = Path(tempfile.gettempdir())
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(prefix)]
    except OSError:
        return
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid():
                continue
            fd = os.open(Path(entry.path) / OWNER_FILE, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its owner lives
            os.close(fd)
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        os.close(fd)
