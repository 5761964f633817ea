"""JIT tuning: tune modules while a script runs, with no code change.

    import aitune.torch.jit.enable      # first import; or run with AITUNE_JIT=1

Modules are recorded as the program calls them and tuned after ``config.min_samples`` calls,
top-down; decisions are remembered in the cache dir so the next run reuses them. See
``docs/jit.md``. The machinery is :mod:`aitune.engine.jit`; this package is its public face.
"""

from __future__ import annotations

from ...engine.install import TunedForward
from ...engine.jit.background import wait
from ...engine.jit.hooks import decisions, disable, enable, enabled, startup, status
from ...engine.jit.settings import settings as config
from ...engine.jit.state import Decision

__all__ = [
    "Decision",
    "TunedForward",
    "config",
    "decisions",
    "disable",
    "enable",
    "enabled",
    "startup",
    "status",
    "wait",
]
