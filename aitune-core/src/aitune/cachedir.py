"""The one folder where aitune keeps what outlives a run.

Its users each keep a subfolder: the build cache of built candidates (``builds/``, see
:mod:`aitune.builtin.buildcache`), the JIT's remembered decisions (see
:mod:`aitune.engine.jit.decision_store`) and the backends' compiler caches (``BuildContext.cache_dir``).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``AITUNE_CACHE_DIR``, else ``$XDG_CACHE_HOME/aitune``, else ``~/.cache/aitune``; created on use.

    In a job of several ranks each rank gets its own folder inside it (``rank-R-of-W``), so ranks
    never write the same entries at once.
    """
    from .distributed import rank_label

    explicit = os.environ.get("AITUNE_CACHE_DIR")
    if explicit:
        path = Path(explicit)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(base) / "aitune"
    label = rank_label()
    if label is not None:
        path = path / label
    path.mkdir(parents=True, exist_ok=True)
    return path
