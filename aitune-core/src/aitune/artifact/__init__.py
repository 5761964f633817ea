"""The ``.ait`` artifact: one zip file that loads a tuned model with no build and no pickle."""

from .archive import FORMAT_VERSION
from .format import GraphEntry, Manifest, ModuleEntry
from .load import load, verify
from .save import save

__all__ = ["FORMAT_VERSION", "GraphEntry", "Manifest", "ModuleEntry", "load", "save", "verify"]
