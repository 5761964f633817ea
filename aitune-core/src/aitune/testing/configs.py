"""Backend configs to and from JSON with the process's plugins (or a ``manager``'s), as an artifact or a
cache stores them.

For tests and scripts: code that runs inside aitune is handed a session and uses
``session.registry.config_to_json`` instead.
"""

from __future__ import annotations

from typing import Any

from ..plugins import AituneManager, get_manager


def config_to_json(config: Any, backend: str | None = None, *, manager: AituneManager | None = None) -> dict[str, Any]:
    """:meth:`aitune.registry.BackendRegistry.config_to_json` with the process's plugins (or ``manager``'s)."""
    return (get_manager() if manager is None else manager).registry.config_to_json(config, backend)


def config_from_json(
    data: Any, what: str = "$", *, from_file: bool = False, manager: AituneManager | None = None
) -> Any:
    """:meth:`aitune.registry.BackendRegistry.config_from_json` with the process's plugins (or
    ``manager``'s; ``from_file=True``: read as an artifact's config is read)."""
    return (get_manager() if manager is None else manager).registry.config_from_json(data, what, from_file=from_file)
