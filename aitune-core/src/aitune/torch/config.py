"""``ait.config``: the process-wide defaults of ``ait.tune`` (``ait.config.max_samples = 16``).

This name is :mod:`aitune.engine.settings` itself, not a copy, so a setting made through either
name is the one the engine reads.
"""

from __future__ import annotations

import sys

from ..engine import settings

sys.modules[__name__] = settings
