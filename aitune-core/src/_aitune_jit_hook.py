"""Turns JIT tuning on at interpreter start; ``aitune_jit.pth`` imports it only when ``AITUNE_JIT`` is set.

The .pth line checks the variable itself, so with it unset no module is even imported (and
pytest, which rewrites every module of a plugin's distribution, never sees this one loaded).
``AITUNE_JIT=0`` (or ``false``, ``no``, ``off``) leaves JIT tuning off; a spelling aitune's one
switch parser does not know leaves it off too, with the message on stderr.
"""

import os
import sys

if os.environ.get("AITUNE_JIT", "").strip():  # unset or empty: nothing is imported
    try:
        from aitune.envvars import switch

        if switch("AITUNE_JIT", False):
            import aitune.torch.jit.enable  # noqa: F401
    except Exception as exc:  # a broken install or a misspelt switch must not stop every Python program from starting
        print(f"aitune: AITUNE_JIT is set but JIT tuning could not start: {type(exc).__name__}: {exc}", file=sys.stderr)
