"""Where Inductor keeps its on-disk cache while aitune builds, so a rebuild reuses earlier work."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path

ENV = "TORCHINDUCTOR_CACHE_DIR"


def inductor_cache_dir(cache_dir: Path) -> Path:
    """The user's own ``TORCHINDUCTOR_CACHE_DIR`` when they set one, else ``<aitune cache>/inductor``.

    Inductor writes its default location into the environment the first time it compiles, so a
    value equal to that default counts as unset.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(ENV)
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    return Path(cache_dir) / "inductor"


def _make_private(folder: Path) -> None:
    """``<aitune cache>/inductor`` holds compiled code Inductor loads and runs: made 0700 whatever the
    umask (Inductor makes its own subfolders with the umask's mode, so this one keeps others out);
    one another user owns, others may write, or that is a link is moved aside and made again."""
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    if not hasattr(os, "getuid"):  # no POSIX owners: the folder's ACL decides
        return
    info = os.lstat(folder)
    if not stat.S_ISLNK(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022:
        if info.st_mode & 0o077:  # readable by others (an older aitune, umask 022): nothing planted, close it
            folder.chmod(0o700)
        return
    warnings.warn(
        f"Inductor's cache {folder} is not yours alone (mode {stat.S_IMODE(info.st_mode):o}, owner {info.st_uid}); "
        "what is cached there runs when used, so it was removed and starts empty",
        RuntimeWarning,
        stacklevel=3,
    )
    aside = folder.with_name(f".evicted-{folder.name}-{os.getpid()}")
    os.rename(folder, aside)
    shutil.rmtree(aside, ignore_errors=True)
    folder.mkdir(mode=0o700)


@contextlib.contextmanager
def inductor_cache(cache_dir: Path) -> Iterator[Path]:
    """Point Inductor (and Triton, which nests under it) at :func:`inductor_cache_dir` for a block."""
    folder = inductor_cache_dir(cache_dir)
    if folder == Path(cache_dir) / "inductor":
        _make_private(folder)
    else:  # the user's own TORCHINDUCTOR_CACHE_DIR: their choice
        folder.mkdir(parents=True, exist_ok=True)
    previous = os.environ.get(ENV)
    os.environ[ENV] = str(folder)
    try:
        yield folder
    finally:
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous
