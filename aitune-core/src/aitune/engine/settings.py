"""Process-wide defaults of ``ait.tune``, set as attributes: ``ait.config.max_samples = 16``.

An argument given to ``ait.tune`` or ``ait.Module`` wins over these; they are read at each call.
JIT mode has its own settings in :mod:`aitune.torch.jit.config`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

max_samples: int = 8
"""Samples kept per graph while recording (distinct shapes are preferred once it is full)."""
fail_fast: bool = False
"""Raise the first error of any module instead of leaving that module eager and going on."""
freeze: bool = True
"""After tuning (and loading), make the parameters of tuned modules inference-only, so a plain
``model(x)`` runs the winner instead of eager (parameters from ``from_pretrained`` require grad)."""
show_progress: bool | None = None
"""Live progress lines; None shows them when stderr is a terminal."""
default_strategy: Callable[[], Any] | None = None
"""Makes the strategy of a module that names none; None means ``MaxThroughputStrategy()`` over
every default backend available on the tune device."""
