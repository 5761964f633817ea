"""Finding and loading plugins: explicit, idempotent, one entry point at a time.

A manager registers core's built-in plugins, then the entry points of the ``aitune`` group: all of
them with :meth:`AituneManager.load_entry_points`, or, in the process's manager
(:func:`get_manager`), each when first needed: a backend looked up by name loads the plugin that
declares it, so ``ait.load`` imports only the plugins of the backends its artifact names; a listing
of backends, the executors, the plugin table or the hook relay loads them all. A plugin that fails
to import is skipped with a warning naming its distribution, version and error (or raises under
``AITUNE_STRICT_PLUGINS=1``). ``AITUNE_DISABLE_PLUGINS`` and ``AITUNE_LOAD_PLUGINS``
(comma-separated entry point or distribution names) filter what loads.
"""

from __future__ import annotations

import importlib.metadata
import re
import threading
import warnings
from typing import Any

import attrs
import pluggy

from . import hookspecs
from .converter import Converter
from .envvars import DISABLE_PLUGINS, LOAD_PLUGINS, STRICT_PLUGINS
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


def strict_plugins() -> bool:
    return STRICT_PLUGINS.get()


class AituneManager:
    """The plugin manager with what its plugins declared: one consistent set of converter, backend
    registry and executor registry. The process has one (:func:`get_manager`); a test or an
    application that wants plugins of its own makes another and passes it as ``manager=`` to
    ``ait.tune``, ``ait.load``, ``ait.save``, ``aitune.torch.jit.enable`` and the CLI's commands."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager("aitune")
        self._pm.add_hookspecs(hookspecs)
        self.converter = Converter()
        """Turns this manager's backend configs into JSON and back (through :attr:`registry`)."""
        self.registry = BackendRegistry(self.converter, discover=self._discover)
        """Its backends; a name it does not hold yet loads the entry points that may declare it."""
        self._executors = ExecutorRegistry()
        self._plugins: dict[str, PluginInfo] = {}
        self._pending: list[tuple[importlib.metadata.EntryPoint, str]] | None = None
        """Entry points found and not loaded yet (with their distribution); None: not looked for."""
        self._versions: dict[str, str] = {}
        self._dists: dict[str, importlib.metadata.Distribution] = {}
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
    def pm(self) -> pluggy.PluginManager:
        """The pluggy manager, with every entry point found so far loaded."""
        self._load_pending()
        return self._pm

    @property
    def hook(self) -> Any:
        """The hook relay, with the entry points found loaded (an observer plugin sees every call)."""
        return self.pm.hook

    @property
    def executors(self) -> ExecutorRegistry:
        """Where isolated builds can run, as the plugins declared (the entry points found are loaded first)."""
        self._load_pending()
        return self._executors

    @property
    def plugins(self) -> dict[str, PluginInfo]:
        """Every plugin by name (entry point or registered name), loaded or failed; loads the entry points found."""
        self._load_pending()
        return self._plugins

    def session(self, builds: BuildQueue | None = None) -> Session:
        """A run's session with this manager's relay and registries (``builds``: the run's builds).

        A tuning run (``builds`` given) loads every entry point first, so every plugin sees the run;
        otherwise (``ait.load``, ``ait.save``) the backends the run looks up load their own plugins.
        """
        if builds is not None:
            self._load_pending()
        return Session(self._pm.hook, self.registry, self._executors, builds)

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
            if self._pm.has_plugin(name) or self._pm.is_registered(plugin):
                return
            backends = BackendRegistrar(self.registry, distribution, name if entry_point else None)
            executors = ExecutorRegistrar(self._executors, distribution)
            try:
                self._pm.register(plugin, name=name)
                self._only(plugin, "aitune_register_backends")(registry=backends)
                self._only(plugin, "aitune_register_executors")(registry=executors)
            except Exception as exc:
                if self._pm.is_registered(plugin):
                    self._pm.unregister(plugin)
                backends.rollback()
                executors.rollback()
                if isinstance(exc, PluginError):
                    raise
                raise PluginError(f"plugin {name!r} from {distribution} failed to register: {exc}") from exc
            self._plugins[name] = PluginInfo(name, distribution, self._version(distribution))

    def _only(self, plugin: object, hook: str) -> Any:
        """``hook`` as implemented by ``plugin`` alone: registration asks each plugin once, in its own name."""
        return self._pm.subset_hook_caller(hook, [p for p in self._pm.get_plugins() if p is not plugin])

    def _version(self, dist: str) -> str:
        """``dist``'s installed version, looked up once per manager (core's plugins share one)."""
        if dist not in self._versions:
            found = self._dists.get(dist)
            self._versions[dist] = (found.version if found is not None else None) or _dist_version(dist)
        return self._versions[dist]

    def find_entry_points(self) -> None:
        """Find the entry points of the ``aitune`` group (package metadata only: nothing is imported),
        filtered by ``AITUNE_DISABLE_PLUGINS`` and ``AITUNE_LOAD_PLUGINS``; each loads when first needed
        (see :meth:`load_entry_points` and :attr:`registry`). Later calls do nothing."""
        with self._lock:
            if self._pending is not None:
                return
            disabled = set(DISABLE_PLUGINS.get() or ())
            listed = LOAD_PLUGINS.get()
            only = None if listed is None else set(listed)
            pending = []
            for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
                dist = ep.dist.name if ep.dist is not None else "unknown"
                if {ep.name, dist} & disabled:
                    continue
                if only is not None and not {ep.name, dist} & only:
                    continue
                if ep.dist is not None:  # at hand: its version is read from it, no search of the path
                    self._dists.setdefault(dist, ep.dist)
                pending.append((ep, dist))
            self._pending = pending

    def load_entry_points(self) -> None:
        """Find and load every entry point of the ``aitune`` group not loaded yet, in name order; later calls do nothing."""
        with self._lock:
            self.find_entry_points()
            self._load_pending()

    def _load_pending(self) -> None:
        """Load every entry point found and not loaded yet (none for a manager that never looked)."""
        with self._lock:
            while self._pending:
                self._load_one(*self._pending.pop(0))

    def _discover(self, backend: str | None) -> None:
        """Load the found entry points that may declare ``backend`` (all of them for None, or when none
        of the likely ones did): those named after it or a prefix of it, then those named after their
        distribution and words of its name (``inductor`` for ``torch_inductor_aot``)."""
        with self._lock:
            if not self._pending:
                return
            if backend is not None:
                for found in [p for p in self._pending if _may_declare(p[0].name, p[1], backend)]:
                    if found not in self._pending:  # a plugin's own lookups loaded it meanwhile
                        continue
                    self._pending.remove(found)
                    self._load_one(*found)
                    if self.registry.declared(backend):
                        return
            self._load_pending()

    def _load_one(self, ep: importlib.metadata.EntryPoint, dist: str) -> None:
        version = self._version(dist)
        try:
            plugin = ep.load()
            self.register(plugin, name=ep.name, distribution=dist, entry_point=True)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            self._plugins[ep.name] = PluginInfo(ep.name, dist, version, error)
            message = f"aitune plugin {ep.name!r} from {dist} {version} failed to load and is skipped: {error}"
            if strict_plugins():
                raise PluginLoadError(message + " (AITUNE_STRICT_PLUGINS is set)") from exc
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def failed_plugins(self) -> list[PluginInfo]:
        return [p for p in self.plugins.values() if p.error]


def _may_declare(entry_point: str, dist: str, backend: str) -> bool:
    """Whether the entry point is likely to declare ``backend`` under the naming rule (see
    :meth:`aitune.registry.BackendRegistry.add`): named after it or a prefix of it, or named after
    its distribution and words of the backend's name."""
    ep, name, where = (
        "_" + "_".join(w for w in re.split(r"[-_.]+", t.lower()) if w) + "_" for t in (entry_point, backend, dist)
    )
    return name.startswith(ep) or (ep in name and where.endswith(ep))


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


_manager: AituneManager | None = None
_manager_lock = threading.Lock()


def get_manager() -> AituneManager:
    """The process-wide manager; its entry-point plugins load when first needed (a backend's plugin
    when the backend is looked up by name, all of them for a listing, the executors or the hooks)."""
    global _manager
    with _manager_lock:
        if _manager is None:
            manager = AituneManager()
            manager.find_entry_points()
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
