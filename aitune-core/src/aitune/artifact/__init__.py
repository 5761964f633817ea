"""The ``.ait`` artifact: one zip file that loads a tuned model with no build and no pickle.

``writer`` makes one (``save``), ``reader`` loads and checks one (``load``, ``verify``); no module
here shares a public function's name, so ``aitune.artifact.load`` is always the function.
"""

from .archive import FORMAT_VERSION
from .format import GraphEntry, Manifest, ModuleEntry
from .options import LoadOptions
from .reader import load, manifest_of, verify
from .writer import save

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
