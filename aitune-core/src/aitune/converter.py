"""The one cattrs converter for every JSON document aitune writes (configs, reports, manifests).

A leaf: it knows attrs classes, not plugins. Backend configs, a tagged union on the backend name
(``{"backend": "onnxruntime", ...}``), go through :meth:`aitune.registry.BackendRegistry.config_to_json`,
which knows the backends. Unknown keys are refused with a message that names the path of the
offending key.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, TypeVar

import cattrs

from .errors import AituneError, ConfigError

T = TypeVar("T")
_lock = threading.Lock()
_converter: cattrs.Converter | None = None


def _make() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_unstructure_hook(Path, str)
    conv.register_structure_hook(Path, lambda v, _: Path(v))
    return conv


def get_converter() -> cattrs.Converter:
    """The process-wide converter (plugins are loaded first, so their configs are known)."""
    global _converter
    with _lock:
        if _converter is None:
            _converter = _make()
        return _converter


def reset() -> None:
    """Forget the converter so the next use rebuilds it (after the set of plugins changed)."""
    global _converter
    with _lock:
        _converter = None


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
    return get_converter().unstructure(obj)


def structure(data: Any, cls: type[T], what: str = "$") -> T:
    """Turn JSON data into ``cls``, raising :class:`ConfigError` with path-qualified messages."""
    try:
        return get_converter().structure(data, cls)
    except (cattrs.BaseValidationError, cattrs.ForbiddenExtraKeysError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(_message(exc, what)) from exc
