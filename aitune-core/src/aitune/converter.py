"""The one cattrs converter for every JSON document aitune writes (configs, reports, manifests).

It is built after plugins are known, because backend configs form a tagged union on the backend
name: ``{"backend": "onnxruntime", "execution_provider": "cpu", ...}``. Unknown keys are refused
with a message that names the path of the offending key.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, TypeVar

import cattrs

from .errors import ConfigError, SerializationError

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
    from .errors import AituneError

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


def config_to_json(config: Any, backend: str | None = None) -> dict[str, Any]:
    """A backend config as a JSON object tagged with its backend name.

    Pass ``backend`` when several backends share one config class.
    """
    from .plugins import get_manager

    registry = get_manager().registry
    names = [backend] if backend is not None else registry.names()
    for name in names:
        if name in registry and registry.config_class(name) is type(config):
            data = {"backend": name, **unstructure(config)}
            try:
                json.dumps(data)
            except (TypeError, ValueError) as exc:
                raise SerializationError(
                    f"the {name} config cannot be written as JSON ({exc}); use settings that have a JSON form"
                ) from exc
            return data
    raise ConfigError(f"{type(config).__name__} belongs to no registered backend; is its plugin installed?")


def config_from_json(data: Any, what: str = "$") -> Any:
    """The backend config that :func:`config_to_json` wrote; the ``backend`` tag picks the class."""
    from .plugins import get_manager

    if not isinstance(data, dict) or "backend" not in data:
        raise ConfigError(f"{what}: a backend config must be an object with a 'backend' key, got {data!r}")
    fields = dict(data)
    name = fields.pop("backend")
    registry = get_manager().registry
    if name not in registry:
        raise ConfigError(f"{what}.backend: unknown backend {name!r}; installed: {sorted(registry.names())}")
    return structure(fields, registry.config_class(name), what)
