"""Where Inductor keeps its on-disk cache while aitune builds, so a rebuild reuses earlier work."""

from __future__ import annotations

import contextlib
import os
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


@contextlib.contextmanager
def inductor_cache(cache_dir: Path) -> Iterator[Path]:
    """Point Inductor (and Triton, which nests under it) at :func:`inductor_cache_dir` for a block."""
    folder = inductor_cache_dir(cache_dir)
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
