"""The manifest of an artifact: attrs classes, JSON through the one cattrs converter."""

from __future__ import annotations

from typing import Any

import attrs

from ..errors import ArtifactError
from ..graph import GraphSpec


@attrs.define
class GraphEntry:
    """One graph of one module: which backend runs it, its config, and where its payload lies."""

    graph: GraphSpec
    backend: str
    config: dict[str, Any]
    distribution: str
    """The pip distribution that provides ``backend``, and its version at save time."""
    distribution_version: str
    payload: str
    """Folder of the payload inside the archive (``modules/0/graphs/1``)."""
    files: list[str] = attrs.field(factory=list)
    metadata: dict[str, Any] = attrs.field(factory=dict)
    """What the backend's ``save`` returned; handed back to its ``load``."""
    refit: bool = False
    """The payload was refitted after it was built (``Backend.refit``), so its files hold older weights:
    ``load`` refits it with the artifact's weights and checks it against eager."""


@attrs.define
class ModuleEntry:
    name: str
    weights: str
    """The safetensors member holding the module's original weights (eager fallback)."""
    graphs: list[GraphEntry] = attrs.field(factory=list)
    path: str | None = attrs.field(default=None, validator=lambda _, __, v: _check_path(v))
    """Where the module sat in the saved object (``"encoder.layer.0"``, ``""`` for the object
    itself), so ``ait.load`` can wrap the same module of a freshly built one. None in artifacts
    written before aitune recorded it."""
    strict: bool = False
    """The wrapper's ``strict``: a call outside what was tuned raises instead of running eager."""
    pad: dict[str, float] = attrs.field(factory=dict)
    """How the model's inputs are padded, as ``ait.tune(pad=...)`` declared it (input name -> pad value),
    for ``aitune serve``; empty when none was declared (and in artifacts written before aitune kept it)."""


def _check_path(path: str | None) -> None:
    """A saved module path is looked up with getattr: refuse segments a hostile file could abuse."""
    if path and any(not part or part.startswith("__") for part in path.split(".")):
        raise ArtifactError(f"module path {path!r} is not a dotted path of attribute or child names")


@attrs.define
class Manifest:
    format_version: int
    created_at: str
    aitune_version: str
    distributions: dict[str, str]
    """Every aitune distribution installed when saving, with its version."""
    environment: dict[str, Any]
    """Where it was tuned: torch, CUDA, GPU or CPU model, runtime library versions."""
    modules: list[ModuleEntry] = attrs.field(factory=list)
