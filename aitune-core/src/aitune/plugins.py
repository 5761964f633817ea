"""Finding and loading plugins: explicit, idempotent, one entry point at a time.

``load_plugins()`` registers core's built-in plugin, then each entry point of the ``aitune``
group. A plugin that fails to import is skipped with a warning naming its distribution, version
and error (or raises under ``AITUNE_STRICT_PLUGINS=1``). ``AITUNE_DISABLE_PLUGINS`` and
``AITUNE_LOAD_PLUGINS`` (comma-separated entry point or distribution names) filter what loads.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
import warnings
from typing import Any

import attrs
import pluggy

from . import hookspecs
from .converter import Converter
from .envvars import switch
from .errors import PluginError, PluginLoadError
from .executor import BuildQueue, ExecutorRegistrar, ExecutorRegistry
from .registry import BackendRegistrar, BackendRegistry
from .session import Session

ENTRY_POINT_GROUP = "aitune"
CORE_DISTRIBUTION = "aitune-core"


@attrs.frozen
class PluginInfo:
    """One plugin: where it came from and whether it loaded."""

    name: str
    distribution: str
    version: str
    error: str | None = None


def _env_list(name: str) -> set[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return {item.strip() for item in raw.split(",") if item.strip()}


def strict_plugins() -> bool:
    return switch("AITUNE_STRICT_PLUGINS", False)


class AituneManager:
    """The plugin manager with what its plugins declared: one consistent set of converter, backend
    registry and executor registry. The process has one (:func:`get_manager`); a test or an
    application that wants plugins of its own makes another and passes it as ``manager=`` to
    ``ait.tune``, ``ait.load``, ``ait.save``, ``aitune.torch.jit.enable`` and the CLI's commands."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("aitune")
        self.pm.add_hookspecs(hookspecs)
        self.converter = Converter()
        """Turns this manager's backend configs into JSON and back (through :attr:`registry`)."""
        self.registry = BackendRegistry(self.converter)
        self.executors = ExecutorRegistry()
        self.plugins: dict[str, PluginInfo] = {}
        self._loaded_entry_points = False
        self._lock = threading.RLock()
        from .builds import isolation, queue
        from .builtin import buildcache, eager, journal, operations

        # plugins that call other hooks take the run's session as a hook argument, never a global
        self.register(operations, name="aitune.builtin.operations", distribution=CORE_DISTRIBUTION)
        self.register(buildcache, name="aitune.builtin.buildcache", distribution=CORE_DISTRIBUTION)
        self.register(isolation, name="aitune.builds.isolation", distribution=CORE_DISTRIBUTION)
        self.register(queue, name="aitune.builds.queue", distribution=CORE_DISTRIBUTION)
        self.register(journal, name="aitune.builtin.journal", distribution=CORE_DISTRIBUTION)
        self.register(eager, name="aitune.builtin.eager", distribution=CORE_DISTRIBUTION)

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def session(self, builds: BuildQueue | None = None) -> Session:
        """A run's session with this manager's relay and registries (``builds``: the run's builds)."""
        return Session(self.pm.hook, self.registry, self.executors, builds)

    def register(
        self, plugin: object, name: str | None = None, distribution: str = "unknown", entry_point: bool = False
    ) -> None:
        """Register a plugin object; its backends are recorded as coming from ``distribution``.

        ``entry_point``: ``name`` is the plugin's entry point, which its backends' names must match.
        The plugin's registration hooks are called here, each with a registrar bound to it; when
        one raises, the plugin is unregistered and everything it declared is taken back.
        """
        with self._lock:
            name = name or getattr(plugin, "__name__", None) or repr(plugin)
            if self.pm.has_plugin(name) or self.pm.is_registered(plugin):
                return
            backends = BackendRegistrar(self.registry, distribution, name if entry_point else None)
            executors = ExecutorRegistrar(self.executors, distribution)
            try:
                self.pm.register(plugin, name=name)
                self._only(plugin, "aitune_register_backends")(registry=backends)
                self._only(plugin, "aitune_register_executors")(registry=executors)
            except Exception as exc:
                if self.pm.is_registered(plugin):
                    self.pm.unregister(plugin)
                backends.rollback()
                executors.rollback()
                if isinstance(exc, PluginError):
                    raise
                raise PluginError(f"plugin {name!r} from {distribution} failed to register: {exc}") from exc
            self.plugins[name] = PluginInfo(name, distribution, _dist_version(distribution))

    def _only(self, plugin: object, hook: str) -> Any:
        """``hook`` as implemented by ``plugin`` alone: registration asks each plugin once, in its own name."""
        return self.pm.subset_hook_caller(hook, [p for p in self.pm.get_plugins() if p is not plugin])

    def load_entry_points(self) -> None:
        """Load every entry point of the ``aitune`` group once; later calls do nothing."""
        with self._lock:
            if self._loaded_entry_points:
                return
            self._loaded_entry_points = True
            disabled = _env_list("AITUNE_DISABLE_PLUGINS") or set()
            only = _env_list("AITUNE_LOAD_PLUGINS")
            for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
                dist = ep.dist.name if ep.dist is not None else "unknown"
                if {ep.name, dist} & disabled:
                    continue
                if only is not None and not {ep.name, dist} & only:
                    continue
                self._load_one(ep, dist)

    def _load_one(self, ep: importlib.metadata.EntryPoint, dist: str) -> None:
        version = _dist_version(dist)
        try:
            plugin = ep.load()
            self.register(plugin, name=ep.name, distribution=dist, entry_point=True)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.plugins[ep.name] = PluginInfo(ep.name, dist, version, error)
            message = f"aitune plugin {ep.name!r} from {dist} {version} failed to load and is skipped: {error}"
            if strict_plugins():
                raise PluginLoadError(message + " (AITUNE_STRICT_PLUGINS is set)") from exc
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def failed_plugins(self) -> list[PluginInfo]:
        return [p for p in self.plugins.values() if p.error]


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


_manager: AituneManager | None = None
_manager_lock = threading.Lock()


def get_manager() -> AituneManager:
    """The process-wide manager, with every entry-point plugin loaded."""
    global _manager
    with _manager_lock:
        if _manager is None:
            manager = AituneManager()
            manager.load_entry_points()
            _manager = manager
        return _manager


def set_manager(manager: AituneManager | None) -> AituneManager | None:
    """Swap the process-wide manager; returns the previous one.

    For what names no manager: the test fixtures whose contract is "process-wide during the
    test" and the lazy names of :mod:`aitune.torch.backend`. A run takes ``manager=`` instead
    (``ait.tune``, ``ait.load``, ``ait.save``, ``aitune.torch.jit.enable``, the CLI's commands).
    """
    global _manager
    with _manager_lock:
        previous, _manager = _manager, manager
        return previous
