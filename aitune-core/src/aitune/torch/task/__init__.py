"""Tasks the tuner runs on candidates (profiling)."""
