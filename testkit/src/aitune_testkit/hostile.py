"""What an attacker would put in an artifact or a cache, for the tests of aitune's trust rules.

``ReadsFile`` is a dataclass whose constructor reads the file its field names: rebuilt from a
manifest by calling it, it would carry a local file into the outputs. ``NativeToyBackend`` is the
toy backend declaring its payload native code, as AOTInductor and TensorRT do, so the rules for
native payloads are tested without a compiler. ``imported_by_name`` is imported by nothing: a
test checks that a file naming it never gets it imported.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

from aitune import hookimpl
from aitune.registry import BackendRegistry
from aitune.testing.backends import ToyBackend, register


@dataclasses.dataclass
class ReadsFile:
    path: str
    out: Any = None
    contents: str | None = None

    def __post_init__(self) -> None:
        self.contents = Path(self.path).read_text()


class Pair(NamedTuple):
    """A named tuple whose ``__new__`` a rebuild never needs."""

    a: Any
    b: Any


class NativeToyBackend(ToyBackend):
    """The toy backend, its payload declared native code (it is not: nothing native runs)."""

    name = "toy_native"
    native_payload = True


@hookimpl
def aitune_register_backends(registry: BackendRegistry) -> None:
    register(registry, (NativeToyBackend,), __name__)
