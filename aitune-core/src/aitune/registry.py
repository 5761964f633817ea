"""The typed registry through which plugins declare backends.

A plugin's ``aitune_register_backends(registry)`` hook calls :meth:`BackendRegistry.add` with a
:class:`BackendSpec`. Specs hold dotted paths, not classes, so listing backends imports no
backend runtime; the classes are imported only when used.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
from packaging.requirements import InvalidRequirement, Requirement

from .errors import BackendNotFoundError, BackendUnavailableError, DuplicateBackendError, PluginError

Probe = Callable[[str], "str | None"]
"""Called with a device type (``"cpu"``, ``"cuda"``); returns why the backend cannot run there, or None."""


def _import_path(path: str) -> Any:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise PluginError(f"{path!r} is not a 'package.module:Name' path")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _strings(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


@attrs.frozen(kw_only=True)
class BackendSpec:
    """What a plugin declares about one backend."""

    name: str = attrs.field(validator=attrs.validators.matches_re(r"^[a-z][a-z0-9_\-]*$"))
    backend_class: str
    """``"package.module:ClassName"`` of the :class:`~aitune.backend.Backend` subclass."""
    config_class: str
    """``"package.module:ClassName"`` of its :class:`~aitune.backend.BackendConfig` subclass."""
    exports: Mapping[str, str] = attrs.field(factory=dict)
    """Further public names for ``aitune.torch.backend`` (enums, helper configs): name -> path."""
    requirements: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    """PEP 508 strings of the runtime libraries this backend needs (``"onnxruntime>=1.17"``)."""
    devices: tuple[str, ...] = attrs.field(default=("cpu", "cuda"), converter=_strings)
    probe: Probe | None = attrs.field(default=None, eq=False)
    """A cheap availability check per device; it must not import heavy runtimes."""
    description: str = ""
    default_candidate: bool = True
    """Whether ``ait.tune`` tries this backend when the user names none (False for quantizing backends)."""
    install_hint: str | None = None
    """What to run when a requirement is missing, e.g. ``pip install 'aitune-backend-tensorrt[runtime]'``."""

    def public_names(self) -> dict[str, str]:
        names = {self.backend_class.rpartition(":")[2]: self.backend_class}
        names[self.config_class.rpartition(":")[2]] = self.config_class
        names.update(self.exports)
        return names


@attrs.frozen
class BackendStatus:
    """Whether a backend can run here, per device, and why not."""

    name: str
    distribution: str
    version: str
    devices: dict[str, str | None]
    """Device type -> None when usable there, else the reason it is not."""

    @property
    def available(self) -> bool:
        return any(reason is None for reason in self.devices.values())

    def reason(self, device: str | None = None) -> str | None:
        if device is not None:
            if device not in self.devices:
                return f"backend {self.name!r} does not support device {device!r} (supports {sorted(self.devices)})"
            return self.devices[device]
        if self.available:
            return None
        return "; ".join(sorted({r for r in self.devices.values() if r}))


@attrs.define
class _Entry:
    spec: BackendSpec
    distribution: str


class BackendRegistry:
    """All backends the loaded plugins declared, by name."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._registering: str = "unknown"

    def add(self, spec: BackendSpec) -> None:
        """Declare a backend; a name that another distribution already declared is refused."""
        if not isinstance(spec, BackendSpec):
            raise PluginError(f"{self._registering} registered {spec!r}, which is not a BackendSpec")
        if spec.name in self._entries:
            other = self._entries[spec.name].distribution
            raise DuplicateBackendError(
                f"backend {spec.name!r} is registered by both {other} and {self._registering}; "
                "uninstall one of them or disable one with AITUNE_DISABLE_PLUGINS"
            )
        self._entries[spec.name] = _Entry(spec, self._registering)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[BackendSpec]:
        return (e.spec for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return list(self._entries)

    def spec(self, name: str) -> BackendSpec:
        try:
            return self._entries[name].spec
        except KeyError:
            raise BackendNotFoundError(
                f"no installed plugin provides the backend {name!r}; installed: {sorted(self._entries)}"
            ) from None

    def distribution(self, name: str) -> str:
        self.spec(name)
        return self._entries[name].distribution

    def status(self, name: str) -> BackendStatus:
        """Check requirements and the probe for every declared device; imports no runtime."""
        spec = self.spec(name)
        dist = self._entries[name].distribution
        missing = missing_requirements(spec.requirements)
        if missing and spec.install_hint:
            missing = f"{missing.split(' (pip install')[0]}; install it with: {spec.install_hint}"
        devices: dict[str, str | None] = {}
        for device in spec.devices:
            if missing:
                devices[device] = missing
                continue
            try:
                devices[device] = spec.probe(device) if spec.probe else None
            except Exception as exc:  # a probe must not take the listing down
                devices[device] = f"availability probe failed: {type(exc).__name__}: {exc}"
        return BackendStatus(name, dist, _version(dist), devices)

    def require(self, name: str, device: str) -> None:
        """Raise :class:`BackendUnavailableError` when ``name`` cannot run on ``device``."""
        reason = self.status(name).reason(device)
        if reason:
            raise BackendUnavailableError(f"backend {name!r} cannot run on {device}: {reason}")

    def backend_class(self, name: str) -> type:
        return _import_path(self.spec(name).backend_class)  # type: ignore[no-any-return]

    def config_class(self, name: str) -> type:
        return _import_path(self.spec(name).config_class)  # type: ignore[no-any-return]

    def public_names(self) -> dict[str, str]:
        """Every public class name a plugin exports, mapped to its dotted path."""
        out: dict[str, str] = {}
        for entry in self._entries.values():
            out.update(entry.spec.public_names())
        return out

    def resolve(self, public_name: str) -> Any:
        return _import_path(self.public_names()[public_name])


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def missing_requirements(requirements: Sequence[str]) -> str | None:
    problems = []
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            problems.append(f"invalid requirement {text!r}: {exc}")
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            found = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{req.name} is not installed (pip install '{text}')")
            continue
        if req.specifier and not req.specifier.contains(found, prereleases=True):
            problems.append(f"{req.name} {found} is installed but {text} is required")
    return "; ".join(problems) or None


def module_importable(name: str) -> bool:
    """True when ``name`` could be imported; finds it without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
