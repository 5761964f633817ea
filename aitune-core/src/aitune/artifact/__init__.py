"""The ``.ait`` artifact: one zip file that loads a tuned model with no build and no pickle.

``writer`` makes one (``save``), ``reader`` loads and checks one (``load``, ``verify``); no module
here shares a public function's name, so ``aitune.artifact.load`` is always the function.
"""

from typing import TYPE_CHECKING, Any

from .archive import FORMAT_VERSION
from .format import GraphEntry, Manifest, ModuleEntry
from .options import LoadOptions
from .reader import load, manifest_of, verify

if TYPE_CHECKING:
    from .writer import save


def __getattr__(name: str) -> Any:
    """``save`` on first use: a process that only loads never imports the writer (or the report)."""
    if name != "save":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .writer import save

    globals()["save"] = save
    return save


__all__ = [
    "FORMAT_VERSION",
    "GraphEntry",
    "LoadOptions",
    "Manifest",
    "ModuleEntry",
    "load",
    "manifest_of",
    "save",
    "verify",
]
