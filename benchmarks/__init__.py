"""aitune's performance harness: is the tuner's pick fast, correct and cheap to load?

Run it with ``python -m benchmarks`` (or ``nox -s bench``). Nothing here is imported by the
test suite, and importing this package imports no torch: ``__main__`` sets the thread variables
first, because OpenMP reads them once, when torch loads.
"""
