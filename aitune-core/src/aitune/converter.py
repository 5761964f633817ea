"""Turning aitune's attrs classes into JSON and back (configs, reports, manifests), with cattrs.

A leaf: it knows attrs classes, not plugins. A :class:`Converter` is one cattrs converter with
aitune's rules: unknown keys are refused, and every refusal names the path of the offending key.
Each plugin manager owns one (:class:`aitune.plugins.AituneManager`), which its registry uses for
backend configs, a tagged union on the backend name (``{"backend": "onnxruntime", ...}``, see
:meth:`aitune.registry.BackendRegistry.config_to_json`), so two managers in a process never share
one. :func:`structure` and :func:`unstructure` serve core's own documents (reports, manifests, the
journal), whose classes no plugin changes, on a converter of this module's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import cattrs

from .errors import AituneError, ConfigError

T = TypeVar("T")


class Converter:
    """One cattrs converter with aitune's rules (it caches each class's hooks on first use)."""

    def __init__(self) -> None:
        self._cattrs = cattrs.Converter(forbid_extra_keys=True)
        self._cattrs.register_unstructure_hook(Path, str)
        self._cattrs.register_structure_hook(Path, lambda v, _: Path(v))

    def unstructure(self, obj: Any) -> Any:
        return self._cattrs.unstructure(obj)

    def structure(self, data: Any, cls: type[T], what: str = "$") -> T:
        """Turn JSON data into ``cls``, raising :class:`ConfigError` with path-qualified messages."""
        try:
            return self._cattrs.structure(data, cls)
        except (cattrs.BaseValidationError, cattrs.ForbiddenExtraKeysError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(_message(exc, what)) from exc


_documents = Converter()
"""Core's own documents: reports, manifests, journals, payload records, and the worker job (which
carries a backend config to the worker process as plain JSON)."""


def _message(exc: Exception, what: str) -> str:
    if isinstance(exc, (cattrs.BaseValidationError, cattrs.ForbiddenExtraKeysError)):
        lines = cattrs.transform_error(exc, path=what, format_exception=_describe)
        return "; ".join(lines)
    return f"{what}: {exc}"


def _describe(exc: BaseException, type_: Any) -> str:
    """Our own errors already say what is wrong; cattrs' generic wording for the rest."""
    if isinstance(exc, AituneError):
        return str(exc)
    return cattrs.v.format_exception(exc, type_)


def unstructure(obj: Any) -> Any:
    """``obj`` as JSON data (one of core's documents; a backend config goes through the registry)."""
    return _documents.unstructure(obj)


def structure(data: Any, cls: type[T], what: str = "$") -> T:
    """Turn JSON data into ``cls``, raising :class:`ConfigError` with path-qualified messages."""
    return _documents.structure(data, cls, what)
