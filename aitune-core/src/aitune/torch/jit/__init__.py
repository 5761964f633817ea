"""JIT tuning: tune modules while a script runs, with no code change.

    import aitune.torch.jit.enable      # first import; or run with AITUNE_JIT=1

Modules are recorded as the program calls them and tuned after ``config.min_samples`` calls,
top-down; decisions are remembered in the cache dir so the next run reuses them. See
``docs/jit.md``.

Layout, one job per file, each importing only those after it: ``hooks`` (switching on and off,
the two forward hooks), ``observe`` (recording a candidate's calls), ``decide`` (what becomes of a
candidate), ``admission`` (which modules become candidates), ``install`` (putting winners in
place), ``state`` (the JIT's state in this process); ``decision_store`` remembers decisions
across runs.
"""

from __future__ import annotations

from . import config
from .hooks import decisions, disable, enable, enabled
from .install import TunedForward
from .state import Decision

__all__ = ["Decision", "TunedForward", "config", "decisions", "disable", "enable", "enabled"]
