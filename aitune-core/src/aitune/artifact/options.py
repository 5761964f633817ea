"""What a caller asks of one ``ait.load``: every option as one frozen, validated value.

``ait.load`` takes its options as keyword arguments or as ``options=LoadOptions(...)``; each serving
engine (``aitune serve``, ``aitune_serve_kserve``, ``aitune_serve_ray``) takes one :class:`LoadOptions`
and passes it on unchanged, so an option added to ``ait.load`` is an option of every server with no
second list to keep in step. Its :meth:`LoadOptions.to_json` form is what a Serve config file's
``load_options:`` holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

DeviceMap = str | torch.device | Mapping[str, str | torch.device] | None


def _one_of(*allowed: str | None) -> Any:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in allowed:
            shown = ", ".join(repr(a) for a in allowed)
            raise ValueError(f"{attribute.name} must be one of {shown}, got {value!r}")

    return check


def _optional_bool(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be True, False or None, got {value!r}")


def _bool(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be True or False, got {value!r}")


def _sha256(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdefABCDEF" for c in value):
        raise ValueError(f"expected_sha256 must be 64 hexadecimal digits, got {value!r}")


def _paths(value: Sequence[str | Path] | str | Path | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, Path)):
        value = [value]
    return tuple(str(p) for p in value) or None


def _device_map(value: DeviceMap) -> str | dict[str, str] | None:
    """Devices as text (what a config file holds); ``ait.load`` checks them against the artifact and
    this machine, with the error that names the module."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    return str(value)


@attrs.frozen
class LoadOptions:
    """Every option of ``ait.load`` (see its docstring for what each does), checked when made."""

    device_map: str | dict[str, str] | None = attrs.field(default=None, converter=_device_map)
    """One device for every module, or ``{"<attr or child name>": device}``; None: as saved."""
    fallback: str | None = attrs.field(default=None, validator=_one_of(None, "eager"))
    expected_sha256: str | None = attrs.field(default=None, validator=_sha256)
    trusted_keys: tuple[str, ...] | None = attrs.field(default=None, converter=_paths)
    signature: str | None = attrs.field(default=None, converter=attrs.converters.optional(str))
    trust_native_code: bool = attrs.field(default=False, validator=_bool)
    freeze: bool | None = attrs.field(default=None, validator=_optional_bool)
    weights: str | None = attrs.field(default=None, validator=_one_of(None, "artifact", "model"))
    check: bool | None = attrs.field(default=None, validator=_optional_bool)
    static_cache: bool = attrs.field(default=True, validator=_bool)

    @classmethod
    def of(cls, value: LoadOptions | Mapping[str, Any] | None) -> LoadOptions:
        """``value`` as options: as given, from ``ait.load``'s keyword arguments (a config file's
        ``load_options:``), or the defaults; an unknown name is refused with the known ones."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"load options must be a LoadOptions or a mapping of ait.load's arguments, got {value!r}")
        known = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"unknown load option {', '.join(map(repr, unknown))}; ait.load takes: {', '.join(sorted(known))}"
            )
        return cls(**value)

    def changed(self) -> dict[str, Any]:
        """The options that differ from the defaults, as ``ait.load``'s keyword arguments."""
        default = LoadOptions()
        return {
            a.name: getattr(self, a.name)
            for a in attrs.fields(LoadOptions)
            if getattr(self, a.name) != getattr(default, a.name)
        }

    def to_json(self) -> dict[str, Any]:
        """The changed options, JSON-ready (tuples as lists): what ``of`` reads back."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.changed().items()}
