"""aitune's own test kit: fault-injection backends, a threaded executor and the survival table.

A test-only distribution of this repository, never published and never in a runtime wheel:
``doubles`` (a module that sleeps, toy backends that answer wrongly, with a NaN, or overwrite
their input), ``faults`` (backends that crash, hang, run out of memory...), ``executors`` (a concurrent executor
to test fan-out anywhere), ``ray_faults`` (a backend whose first build kills its Ray worker) and
``survival`` (``python -m aitune_testkit.survival`` prints what aitune survives). Plugin authors
want :mod:`aitune.testing` instead.
"""

__version__ = "0"
