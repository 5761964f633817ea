"""Builds that run apart from the user's process: one import direction, top to bottom.

``queue`` holds one tune's builds (its executor, builds submitted ahead) and registers the
``local`` executor; ``isolation`` is the ``aitune_build`` plugin that exports a module and has a
worker build it (``LocalExecutor`` runs that worker here); ``worker`` is the worker process itself
(``python -m aitune.builds.worker``). The job they exchange is public in :mod:`aitune.executor`.
"""
