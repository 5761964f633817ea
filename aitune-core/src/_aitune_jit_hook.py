"""Turns JIT tuning on at interpreter start; ``aitune_jit.pth`` imports it only when ``AITUNE_JIT`` is set.

The .pth line checks the variable itself, so with it unset no module is even imported (and
pytest, which rewrites every module of a plugin's distribution, never sees this one loaded).
This module checks again that it is set to more than blanks before importing anything: importing
:mod:`aitune.envvars` costs about 30 ms (aitune's package imports pluggy), too much for every
interpreter start. Those two checks are the only reads of an ``AITUNE_`` variable outside
:mod:`aitune.envvars` (docs/settings.md). The value itself is read there, as every switch:
``AITUNE_JIT=0`` (or ``false``, ``no``, ``off``) leaves JIT tuning off, and a spelling the switch
parser does not know leaves it off too, with the message on stderr.
"""

import os
import sys

if os.environ.get("AITUNE_JIT", "").strip():  # unset or blank: nothing is imported
    try:
        from aitune.envvars import JIT

        if JIT.get():
            import aitune.torch.jit.enable  # noqa: F401
    except Exception as exc:  # a broken install or a misspelt switch must not stop every Python program from starting
        print(f"aitune: AITUNE_JIT is set but JIT tuning could not start: {type(exc).__name__}: {exc}", file=sys.stderr)
