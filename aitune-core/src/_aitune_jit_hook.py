"""Started by ``aitune_jit.pth`` at every interpreter start: turns JIT tuning on when ``AITUNE_JIT`` is set.

With the variable unset this costs one environment lookup: nothing else is imported.
"""

import os

if os.environ.get("AITUNE_JIT", "").strip().lower() in {"1", "true", "yes", "on"}:
    try:
        import aitune.torch.jit.enable  # noqa: F401
    except Exception as exc:  # a broken install must not stop every Python program from starting
        import sys

        print(f"aitune: AITUNE_JIT is set but JIT tuning could not start: {type(exc).__name__}: {exc}", file=sys.stderr)
