"""One run of aitune (a tune, a save, a load, a JIT decision), handed down from its entry point.

The entry points (``ait.tune``, ``ait.save``, ``ait.load``, the JIT, the CLI) make one
:class:`Session` from the plugin manager; everything below them is handed it, as pytest hands its
hooks ``config`` and ``session``. Operation hooks receive it as ``session``, so a plugin that needs
the hook relay, the registry or the run's builds gets them here, never from a global; so do the
observers, and a plugin keeps what it needs for the run in ``session.stash``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from .executor import BuildQueue, ExecutorRegistry
    from .registry import BackendRegistry


@attrs.frozen
class Session:
    """What one run works with: the hook relay, the registries, and the run's builds."""

    hook: Any
    """The plugin manager's hook relay: every build, validation, profile and payload goes through it."""
    registry: BackendRegistry
    executors: ExecutorRegistry
    builds: BuildQueue | None = None
    """The run's builds (its executor and those submitted ahead); None where nothing is built
    ahead (loading, saving, a direct hook call): isolated builds then run in a local worker."""
    stash: dict[str, Any] = attrs.field(factory=dict)
    """What a plugin keeps for this run alone, under a key of its own (``"aitune.journal"``), as
    pytest's ``stash``: run state lives here, never in a module global."""
