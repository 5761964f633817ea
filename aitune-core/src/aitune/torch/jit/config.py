"""Settings of JIT tuning (``jit_config.min_samples = 3``): :mod:`aitune.engine.jit.settings` itself."""

from __future__ import annotations

import sys

from ...engine.jit import settings

sys.modules[__name__] = settings
