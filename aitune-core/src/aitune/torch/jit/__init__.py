"""JIT tuning: tune modules while a script runs, with no code change.

    import aitune.torch.jit.enable      # first import; or run with AITUNE_JIT=1

Modules are recorded as the program calls them and tuned after ``config.min_samples`` calls,
top-down; decisions are remembered in the cache dir so the next run reuses them. See
``docs/jit.md``.
"""

from __future__ import annotations

from . import config
from .engine import Decision, TunedForward, decisions, disable, enable, enabled

__all__ = ["Decision", "TunedForward", "config", "decisions", "disable", "enable", "enabled"]
