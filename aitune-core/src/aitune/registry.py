"""The typed registry through which plugins declare backends.

A plugin's ``aitune_register_backends(registry)`` hook is handed a :class:`BackendRegistrar` bound
to its distribution and calls its ``add`` with a :class:`BackendSpec`. A backend is declared once,
on its :class:`~aitune.backend.Backend` class (``name``, ``config_class``, ``devices``):
registration imports that class (its module must import no runtime, only torch and aitune) and
fills the spec from it, refusing a spec that says otherwise. Runtimes are checked by requirement
strings and probes, so listing backends imports none.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from .backend import Backend, BackendConfig
from .converter import Converter
from .errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    ConfigError,
    DuplicateBackendError,
    PluginError,
    SerializationError,
)

if TYPE_CHECKING:
    import torch

    from .graph import GraphSpec

Probe = Callable[[str], "str | None"]
"""Called with a device type (``"cpu"``, ``"cuda"``); returns why the backend cannot run there, or None."""

NAME_RULE = r"^[a-z][a-z0-9_\-]*$"
"""A backend name: lower case, starting with a letter; digits, ``_`` and ``-`` after that."""


def import_path(path: str) -> Any:
    """The object a registered spec names as ``package.module:Name`` (never a path read from a file)."""
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
    """What a plugin declares about one backend.

    Only ``backend_class`` is required: ``name``, ``config_class`` and ``devices`` come from the
    Backend class at registration. A spec that states one of them anyway must agree with the class.
    """

    backend_class: str
    """``"package.module:ClassName"`` of the :class:`~aitune.backend.Backend` subclass."""
    name: str = attrs.field(default="", validator=attrs.validators.matches_re(f"({NAME_RULE})|^$"))
    """Filled from ``Backend.name`` at registration."""
    config_class: str = ""
    """``"package.module:ClassName"`` of its config; filled from ``Backend.config_class`` at registration."""
    exports: Mapping[str, str] = attrs.field(factory=dict)
    """Further public names for ``aitune.torch.backend`` (enums, helper configs): name -> path."""
    requirements: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    """PEP 508 strings of the runtime libraries this backend needs (``"onnxruntime>=1.17"``)."""
    devices: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    """Device types it runs on; filled from ``Backend.devices`` at registration."""
    probe: Probe | None = attrs.field(default=None, eq=False)
    """A cheap availability check per device; it must not import heavy runtimes. Whatever it answers,
    a device type the machine lacks (no CUDA device) is reported unavailable."""
    description: str = ""
    """One line for ``aitune backends``."""
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


Discover = Callable[[str | None], None]
"""Loads the plugins that may declare a backend name (every plugin for None); see :class:`BackendRegistry`."""


class BackendRegistry:
    """All backends the loaded plugins declared, by name.

    ``discover`` (the manager's) loads plugins on demand: a lookup of a name the registry does not
    hold yet asks it for that name's plugin, and a listing (``names``, iteration, ``public_names``)
    for every plugin, so that ``ait.load`` imports only the plugins its artifact needs.
    """

    def __init__(self, converter: Converter | None = None, discover: Discover | None = None) -> None:
        self._entries: dict[str, _Entry] = {}
        self._converter = converter or Converter()
        """Turns backend configs into JSON and back: the manager's own (see :class:`aitune.plugins.AituneManager`)."""
        self._discover = discover

    def add(self, spec: BackendSpec, *, distribution: str = "unknown", entry_point: str | None = None) -> BackendSpec:
        """Declare a backend of ``distribution``; returns the spec completed from its Backend class.

        ``entry_point``: the entry point the declaring plugin was loaded from (None for a plugin
        registered in code). Refused: a spec that disagrees with its Backend class, a name that
        another distribution already declared, a name that does not match its entry point.
        Plugins call this through the :class:`BackendRegistrar` they are handed.
        """
        if not isinstance(spec, BackendSpec):
            raise PluginError(f"{distribution} registered {spec!r}, which is not a BackendSpec")
        spec = _complete(spec, distribution)
        if spec.name in self._entries:
            other = self._entries[spec.name].distribution
            raise DuplicateBackendError(
                f"backend {spec.name!r} is registered by both {other} and {distribution}; "
                "uninstall one of them or disable one with AITUNE_DISABLE_PLUGINS"
            )
        if entry_point is not None and not _entry_point_matches(entry_point, distribution, spec.name):
            raise PluginError(
                f"entry point {entry_point!r} of {distribution} registers the backend {spec.name!r}; "
                f"name the entry point after the backend ({spec.name!r}), a prefix of its backends' names, "
                f"or the distribution, so that AITUNE_DISABLE_PLUGINS and `aitune backends` agree"
            )
        self._entries[spec.name] = _Entry(spec, distribution)
        return spec

    def remove(self, name: str) -> None:
        """Forget the backend ``name`` (a registration that failed half-way takes back what it added)."""
        self._entries.pop(name, None)

    def _find(self, name: str) -> _Entry | None:
        """The entry of ``name``, after loading the plugins that may declare it when it is not held yet."""
        if name not in self._entries and self._discover is not None:
            self._discover(name)
        return self._entries.get(name)

    def _everything(self) -> dict[str, _Entry]:
        """Every entry, after loading every plugin."""
        if self._discover is not None:
            self._discover(None)
        return self._entries

    def declared(self, name: str) -> bool:
        """Whether a plugin loaded so far declared ``name`` (loads nothing)."""
        return name in self._entries

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._find(name) is not None

    def __iter__(self) -> Iterator[BackendSpec]:
        return (e.spec for e in list(self._everything().values()))

    def __len__(self) -> int:
        return len(self._everything())

    def names(self) -> list[str]:
        return list(self._everything())

    def spec(self, name: str) -> BackendSpec:
        return self._entry(name).spec

    def _entry(self, name: str) -> _Entry:
        entry = self._find(name)
        if entry is None:
            raise BackendNotFoundError(
                f"no installed plugin provides the backend {name!r}; installed: {sorted(self._everything())}"
            )
        return entry

    def distribution(self, name: str) -> str:
        return self._entry(name).distribution

    def status(self, name: str) -> BackendStatus:
        """Check requirements and the probe for every declared device; imports no runtime."""
        entry = self._entry(name)
        spec, dist = entry.spec, entry.distribution
        missing = missing_requirements(spec.requirements)
        if missing and spec.install_hint:
            missing = f"{missing.split(' (pip install')[0]}; install it with: {spec.install_hint}"
        devices: dict[str, str | None] = {}
        for device in spec.devices:
            if missing:
                devices[device] = missing
                continue
            try:
                # the plugin's own reason first (it says more); a probe that answers None on a
                # machine without the device still leaves the device unavailable
                devices[device] = (spec.probe(device) if spec.probe else None) or device_absent(device)
            except Exception as exc:  # a probe must not take the listing down
                devices[device] = f"availability probe failed: {type(exc).__name__}: {exc}"
        return BackendStatus(name, dist, _version(dist), devices)

    def unavailable(self, backend: Backend | str, device: torch.device, graph: GraphSpec | None = None) -> str | None:
        """Why ``backend`` (an object, or a registered name) cannot run on ``device``, or None when it can.

        The one availability check: a registered backend's runtimes and probe (no runtime is
        imported), then, for a backend object and a ``graph``, the backend's own word on the graph.
        A backend no plugin registered (built by hand) answers for itself.
        """
        name = backend if isinstance(backend, str) else backend.name
        if name in self:
            reason = self.status(name).reason(device.type)
            if reason:
                return reason
        if isinstance(backend, str) or graph is None:
            return None
        if graph.mutated and not backend.mutates_inputs:
            shown = ", ".join(graph.mutated[:3]) + (
                f" and {len(graph.mutated) - 3} more" if len(graph.mutated) > 3 else ""
            )
            return (
                f"the module updates inputs in place ({shown}, as a static KV cache does) and this backend does not write "
                "updates back to its inputs (Backend.mutates_inputs is False)"
            )
        return backend.unsupported_reason(graph, device)

    def require(self, name: str, device: torch.device) -> None:
        """Raise :class:`BackendUnavailableError` when ``name`` cannot run on ``device``."""
        reason = self.unavailable(name, device)
        if reason:
            raise BackendUnavailableError(f"backend {name!r} cannot run on {device}: {reason}")

    def backend_class(self, name: str) -> type[Backend]:
        return import_path(self.spec(name).backend_class)

    def config_class(self, name: str) -> type:
        return import_path(self.spec(name).config_class)

    def public_names(self) -> dict[str, str]:
        """Every public class name a plugin exports, mapped to its dotted path."""
        out: dict[str, str] = {}
        for entry in self._everything().values():
            out.update(entry.spec.public_names())
        return out

    def resolve(self, public_name: str) -> Any:
        return import_path(self.public_names()[public_name])

    def config_to_json(self, config: Any, backend: str | None = None) -> dict[str, Any]:
        """A backend config as a JSON object tagged with its backend name.

        Pass ``backend`` when several backends share one config class.
        """
        for name in [backend] if backend is not None else self.names():
            if name in self and self.config_class(name) is type(config):
                data = {"backend": name, **self._converter.unstructure(config)}
                try:
                    json.dumps(data)
                except (TypeError, ValueError) as exc:
                    raise SerializationError(
                        f"the {name} config cannot be written as JSON ({exc}); use settings that have a JSON form"
                    ) from exc
                return data
        raise ConfigError(f"{type(config).__name__} belongs to no registered backend; is its plugin installed?")

    def config_from_json(self, data: Any, what: str = "$", *, from_file: bool = False) -> Any:
        """The backend config that :meth:`config_to_json` wrote; the ``backend`` tag picks the class.

        ``from_file``: the JSON came from an artifact, a cache entry or the JIT store, so a setting
        the config does not trust from a file (:meth:`BackendConfig.untrusted_settings`) is refused
        by name before anything uses the config.
        """
        if not isinstance(data, dict) or "backend" not in data:
            raise ConfigError(f"{what}: a backend config must be an object with a 'backend' key, got {data!r}")
        fields = dict(data)
        name = fields.pop("backend")
        if not isinstance(name, str) or name not in self:
            raise ConfigError(f"{what}.backend: unknown backend {name!r}; installed: {sorted(self.names())}")
        config: BackendConfig = self._converter.structure(fields, self.config_class(name), what)
        refused = config.untrusted_settings() if from_file else []
        if refused:
            raise ConfigError(
                f"{what}: the {name} config sets what aitune does not take from a file: {'; '.join(refused)}. "
                "Set such options in your own code (they run on your machine), never through a saved file"
            )
        return config


@attrs.frozen
class BackendRegistrar:
    """The ``registry`` that one plugin's ``aitune_register_backends`` hook is handed.

    Made by the plugin manager for each plugin it registers, bound to that plugin's distribution
    and entry point, so the backends it adds are recorded as theirs; when the registration fails,
    the manager takes back what it added (:meth:`rollback`).
    """

    registry: BackendRegistry
    distribution: str
    entry_point: str | None = None
    """The entry point the plugin was loaded from; None for a plugin registered in code."""
    added: list[str] = attrs.field(factory=list, init=False)
    """The names this plugin declared, in order."""

    def add(self, spec: BackendSpec) -> None:
        """Declare one backend of this plugin (see :meth:`BackendRegistry.add` for what is refused)."""
        self.added.append(self.registry.add(spec, distribution=self.distribution, entry_point=self.entry_point).name)

    def rollback(self) -> None:
        """Take back every backend this plugin declared."""
        for name in reversed(self.added):
            self.registry.remove(name)
        self.added.clear()


def _complete(spec: BackendSpec, distribution: str) -> BackendSpec:
    """``spec`` with name, config class and devices from its Backend class; a disagreement is refused."""
    where = f"{distribution} declares {spec.backend_class!r}"
    try:
        cls = import_path(spec.backend_class)
    except Exception as exc:
        raise PluginError(
            f"{where}, which cannot be imported ({type(exc).__name__}: {exc}); a Backend's module must import "
            "with only torch and aitune installed (import runtimes inside its methods)"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise PluginError(f"{where}, which is not a subclass of aitune.backend.Backend")
    if not cls.name or not re.match(NAME_RULE, cls.name):
        raise PluginError(f"{where}, whose name {cls.name!r} does not follow the rule {NAME_RULE} (e.g. 'my_backend')")
    config = cls.config_class
    if config is BackendConfig:
        raise PluginError(f"{where}, which sets no config_class (a frozen attrs subclass of BackendConfig)")
    own_devices = any("devices" in vars(c) for c in cls.__mro__ if c is not Backend)
    problems = []
    if spec.name and spec.name != cls.name:
        problems.append(f"name {spec.name!r} in the spec, {cls.name!r} on the class")
    if spec.config_class and import_path(spec.config_class) is not config:
        problems.append(f"config {spec.config_class!r} in the spec, {config.__qualname__} on the class")
    if spec.devices and own_devices and set(spec.devices) != set(cls.devices):
        problems.append(f"devices {list(spec.devices)} in the spec, {list(cls.devices)} on the class")
    if problems:
        raise PluginError(
            f"{where}, which disagrees with its spec: {'; '.join(problems)}; declare them once, on the class"
        )
    return attrs.evolve(
        spec,
        name=cls.name,
        config_class=spec.config_class or f"{config.__module__}:{config.__qualname__}",
        devices=spec.devices or cls.devices,
    )


def _entry_point_matches(entry_point: str, distribution: str, name: str) -> bool:
    """The entry point is named after the backend, a prefix of its name, or the distribution."""

    def norm(text: str) -> str:
        return text.lower().replace("-", "_").replace(".", "_")

    ep, name, dist = norm(entry_point), norm(name), norm(distribution)
    return name == ep or name.startswith(ep + "_") or dist in (ep, f"aitune_backend_{ep}")


def device_absent(device: str) -> str | None:
    """Why this machine has no ``device`` at all (the check every backend gets before its probe)."""
    if device == "cpu":
        return None
    import torch

    backend = getattr(torch, device, None)
    is_available = getattr(backend, "is_available", None)
    if is_available is None:
        return f"torch knows no device type {device!r}"
    if not is_available():
        return f"no {device.upper() if device == 'cuda' else device} device is visible to torch"
    return None


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


_PLAIN_REQUIREMENT = re.compile(
    r"^\s*(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*"
    r"(?P<specifier>(?:[<>!=~]=?|===)\s*[A-Za-z0-9.*+!_-]+(?:\s*,\s*(?:[<>!=~]=?|===)\s*[A-Za-z0-9.*+!_-]+)*)?\s*$"
)
"""A name and version specifiers, nothing else (no extras, markers or URL): what backends declare."""

_RELEASE_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*$")
"""One clause comparing with a plain release (``>=1.16``): no wildcard, pre-, post- or dev-release."""
_INSTALLED_RELEASE = re.compile(r"^(\d+(?:\.\d+)*)(?:\+[A-Za-z0-9.]+)?$")
"""An installed plain release, with or without a local label (``2.13.0+cpu``)."""
_ORDER = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
}


def _release(text: str, width: int) -> tuple[int, ...]:
    parts = [int(p) for p in text.split(".")]
    return tuple(parts + [0] * (width - len(parts)))


def _releases_fit(clauses: Sequence[str], found: str) -> bool | None:
    """Whether the installed ``found`` meets every clause, when all are plain releases: compared as
    PEP 440 does them (zeros padded, an installed local label ignored, as a clause without one
    ignores it). None for anything else, which ``packaging`` decides: a load checks a backend's
    requirements, and ``packaging.specifiers`` alone costs a cold start about 20 ms of imports."""
    installed = _INSTALLED_RELEASE.match(found)
    matched = [_RELEASE_CLAUSE.match(c) for c in clauses]
    if installed is None or not all(matched):
        return None
    for m in matched:
        assert m is not None
        width = max(m[2].count("."), installed[1].count(".")) + 1
        if not _ORDER[m[1]](_release(installed[1], width), _release(m[2], width)):
            return False
    return True


def _parse_requirement(text: str) -> tuple[str, Any, Any]:
    """``(name, specifier, marker or None)`` of a PEP 508 string; a ValueError when it is not one.

    A plain ``name>=1.2,<2`` of plain releases keeps its clauses as text (:func:`_releases_fit`
    checks them); other plain ones need only ``packaging.specifiers``; anything else is parsed by
    ``packaging.requirements``, which costs a cold start about twice as much to import.
    """
    plain = _PLAIN_REQUIREMENT.match(text)
    if plain is not None:
        clauses = plain["specifier"].split(",") if plain["specifier"] else []
        if all(_RELEASE_CLAUSE.match(c) for c in clauses):
            return plain["name"], tuple(clauses), None
        from packaging.specifiers import InvalidSpecifier, SpecifierSet

        try:
            return plain["name"], SpecifierSet(plain["specifier"] or ""), None
        except InvalidSpecifier as exc:
            raise ValueError(str(exc)) from exc
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        req = Requirement(text)
    except InvalidRequirement as exc:
        raise ValueError(str(exc)) from exc
    return req.name, req.specifier, req.marker


def _fits(specifier: Any, found: str) -> bool:
    if isinstance(specifier, tuple):  # plain release clauses, kept as text
        fit = _releases_fit(specifier, found)
        if fit is not None:
            return fit
        from packaging.specifiers import SpecifierSet  # an installed pre-release, or another scheme

        specifier = SpecifierSet(",".join(specifier))
    return bool(specifier.contains(found, prereleases=True))


def missing_requirements(requirements: Sequence[str]) -> str | None:
    problems = []
    for text in requirements:
        try:
            name, specifier, marker = _parse_requirement(text)
        except ValueError as exc:
            problems.append(f"invalid requirement {text!r}: {exc}")
            continue
        if marker is not None and not marker.evaluate():
            continue
        try:
            found = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{name} is not installed (pip install '{text}')")
            continue
        if specifier and not _fits(specifier, found):
            problems.append(f"{name} {found} is installed but {text} is required")
    return "; ".join(problems) or None


def module_importable(name: str) -> bool:
    """True when ``name`` could be imported; finds it without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
