"""Core's own plugins, registered before any entry point as ``aitune.builtin.<module>``.

``operations``: the default implementation of every operation hook (``trylast``); ``eager``: the
eager backend; ``buildcache``: the build cache around ``aitune_build``; ``isolation``: builds in a
worker process; ``executor``: the ``local`` executor and each tune's builds; ``journal``: the tuning
journal. docs/plugins.md gives their order.
"""
