"""Where isolated builds run: the executor extension point.

A build that a backend can export (see :mod:`aitune.builtin.isolation`) is a job: JSON plus the files
``export`` wrote, never a pickled module. An :class:`Executor` runs jobs. Core's ``local``
executor runs each one in a worker process on this machine when a strategy asks for it. A plugin
registers more through ``aitune_register_executors`` (``aitune-executor-ray`` runs them as Ray
tasks). An executor that runs jobs side by side (``concurrent``) is handed every build of the
pipeline right after recording; the strategies then take the results in their own order.

Validation and profiling stay in the user's process, one at a time, and profiling waits until no
build is in flight, because timings taken next to a compiler are worthless.

Choose with ``ait.tune(..., executor="ray")`` or ``AITUNE_EXECUTOR=ray``; the default is ``local``.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from . import hookimpl
from .errors import ConfigError, PluginError

if TYPE_CHECKING:
    import torch

    from .backend import Backend, BuildContext
    from .plugins import AituneManager
    from .registry import BackendRegistry

logger = logging.getLogger("aitune")

DEFAULT = "local"
FIRST_PARTY = {"ray": "aitune-executor-ray"}
"""Executors of first-party distributions, so asking for one that is missing says what to install."""


@attrs.frozen
class BuildRequest:
    """One exported build, as the user's process holds it: ``folder/exported`` holds the files."""

    backend: Backend
    notes: dict[str, Any]
    context: BuildContext
    folder: Path

    @property
    def what(self) -> str:
        return f"{self.backend.name} build of {self.context.module_name or 'the module'}"


class BuildHandle(abc.ABC):
    """A submitted build."""

    worker_s: float | None = None
    """How long the build itself ran where it ran, once known (the wait here may be shorter)."""

    @abc.abstractmethod
    def result(self) -> dict[str, Any]:
        """Wait for the build; return the payload's metadata, with the payload in ``folder/payload``.

        Raises :class:`~aitune.builtin.isolation.WorkerBuildError` when the build failed or its worker died.
        """

    def wait(self) -> None:
        """Wait until the build is over, without raising; :meth:`result` then answers at once."""
        return None

    def cancel(self) -> None:
        """Stop a build whose result nobody will ask for."""
        return None


class Executor(abc.ABC):
    """Runs build jobs somewhere: a worker process here, a task on a cluster."""

    name: ClassVar[str] = ""
    concurrent: ClassVar[bool] = False
    """True when submitted builds run side by side, so submitting them all ahead pays off."""

    @abc.abstractmethod
    def submit(self, request: BuildRequest) -> BuildHandle:
        """Start ``request``'s build (or queue it); never blocks on the build itself."""

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """JSON-able facts for ``aitune backends``: where builds run and the resources there.

        A class method: listing must not start anything (no cluster, no worker).
        """
        return {}

    def close(self) -> None:
        """The tune is over; release what the executor holds (not a cluster it did not start)."""
        return None


class _Deferred(BuildHandle):
    def __init__(self, run: Callable[[], dict[str, Any]]) -> None:
        self._run = run

    def result(self) -> dict[str, Any]:
        return self._run()


class LocalExecutor(Executor):
    """Each build in a worker process on this machine, when the strategy asks for it."""

    name = "local"

    def submit(self, request: BuildRequest) -> BuildHandle:
        from .builtin import isolation

        return _Deferred(lambda: isolation.run_worker(request.backend, request.notes, request.context, request.folder))

    @classmethod
    def describe(cls) -> dict[str, Any]:
        import torch

        return {"where": "worker processes on this machine", "CPU": os.cpu_count(), "GPU": torch.cuda.device_count()}


# -- the registry -------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ExecutorSpec:
    """What a plugin declares about one executor."""

    name: str = attrs.field(validator=attrs.validators.matches_re(r"^[a-z][a-z0-9_\-]*$"))
    executor_class: str
    """``"package.module:ClassName"`` of the :class:`Executor` subclass, imported only when used."""
    requirements: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """PEP 508 strings of the libraries it needs (``"ray>=2.9"``)."""
    description: str = ""


class ExecutorRegistry:
    """Every executor the loaded plugins declared, by name."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[ExecutorSpec, str]] = {}
        self._registering = "unknown"

    def add(self, spec: ExecutorSpec) -> None:
        if not isinstance(spec, ExecutorSpec):
            raise PluginError(f"{self._registering} registered {spec!r}, which is not an ExecutorSpec")
        if spec.name in self._entries:
            raise PluginError(
                f"executor {spec.name!r} is registered by both {self._entries[spec.name][1]} and "
                f"{self._registering}; uninstall one of them"
            )
        self._entries[spec.name] = (spec, self._registering)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def spec(self, name: str) -> ExecutorSpec:
        if name not in self._entries:
            hint = f"; install it with: pip install {FIRST_PARTY[name]}" if name in FIRST_PARTY else ""
            raise ConfigError(
                f"no installed plugin provides the executor {name!r} (installed: {', '.join(sorted(self._entries))}){hint}"
            )
        return self._entries[name][0]

    def distribution(self, name: str) -> str:
        self.spec(name)
        return self._entries[name][1]

    def reason(self, name: str) -> str | None:
        """Why ``name`` cannot run here (a missing requirement), or None."""
        from .registry import missing_requirements

        return missing_requirements(self.spec(name).requirements)

    def executor_class(self, name: str) -> type[Executor]:
        from .registry import _import_path

        cls = _import_path(self.spec(name).executor_class)
        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise PluginError(f"{self.spec(name).executor_class} is not an aitune Executor class")
        return cls

    def create(self, name: str) -> Executor:
        reason = self.reason(name)
        if reason:
            raise ConfigError(f"the {name} executor cannot run here: {reason}")
        return self.executor_class(name)()


@hookimpl
def aitune_register_executors(registry: ExecutorRegistry) -> None:
    registry.add(
        ExecutorSpec(
            name=DEFAULT,
            executor_class=f"{__name__}:LocalExecutor",
            description="worker processes on this machine, one build at a time",
        )
    )


def chosen(name: str | None = None) -> str:
    """The executor to use: ``name``, else ``AITUNE_EXECUTOR``, else ``local``."""
    value = name if name is not None else os.environ.get("AITUNE_EXECUTOR", "").strip()
    return value.strip().lower() or DEFAULT


# -- one tune's builds --------------------------------------------------------------------------


@attrs.define
class _Ahead:
    request: BuildRequest
    handle: BuildHandle


class BuildSession:
    """The builds of one ``ait.tune``: its executor and the builds submitted ahead, by build key."""

    def __init__(self, executor: Executor, registry: BackendRegistry | None = None) -> None:
        self.executor = executor
        self.registry = registry  # build keys name each backend's distribution; None: nothing is sent ahead
        self._ahead: dict[str, _Ahead] = {}
        self._root: Path | None = None

    def folder(self) -> Path:
        """A fresh folder for one build, removed when the session ends."""
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="aitune-builds-"))
        return Path(tempfile.mkdtemp(dir=self._root))

    def submit_ahead(self, backend: Backend, module: torch.nn.Module, context: BuildContext) -> bool:
        """Export ``backend``'s build now and hand it to the executor; False when it is not one to send.

        Builds that do not run in a worker, cache hits and failed exports are left to the strategy,
        which builds (and reports) them the usual way.
        """
        from .builtin import buildcache, isolation

        if self.registry is None or not isolation.isolated(backend):
            return False
        try:
            key = buildcache.build_key(backend, module, context, self.registry)
        except Exception:  # a config that cannot be keyed is built when asked for
            return False
        if key in self._ahead or (buildcache.enabled() and (buildcache.builds_dir() / key[:2] / key).is_dir()):
            return False
        folder = self.folder()
        try:
            (folder / "exported").mkdir()
            notes = backend.export(module, context, folder / "exported")
        except Exception as exc:
            logger.debug("%s: %s not built ahead, its export failed: %s", context.module_name, backend.name, exc)
            return False
        if notes is None:
            return False
        request = BuildRequest(backend, notes, context, folder)
        self._ahead[key] = _Ahead(request, self.executor.submit(request))
        return True

    def take(
        self, backend: Backend, module: torch.nn.Module, context: BuildContext
    ) -> tuple[BuildRequest, BuildHandle] | None:
        """The build of ``backend`` submitted ahead for this module and graph, if any."""
        if not self._ahead or self.registry is None:
            return None
        from .builtin import buildcache

        try:
            ahead = self._ahead.pop(buildcache.build_key(backend, module, context, self.registry), None)
        except Exception:
            return None
        return (ahead.request, ahead.handle) if ahead is not None else None

    def wait_idle(self) -> None:
        """Wait until no build submitted ahead is running (before profiling)."""
        for ahead in self._ahead.values():
            ahead.handle.wait()

    def close(self) -> None:
        for ahead in self._ahead.values():
            with contextlib.suppress(Exception):
                ahead.handle.cancel()
        self._ahead.clear()
        try:
            self.executor.close()
        finally:
            if self._root is not None:
                shutil.rmtree(self._root, ignore_errors=True)


_active: contextvars.ContextVar[BuildSession | None] = contextvars.ContextVar("aitune_build_session", default=None)


def active() -> BuildSession:
    """The running tune's build session; outside ``ait.tune`` (JIT, direct hook calls) a local one."""
    session = _active.get()
    return session if session is not None else BuildSession(LocalExecutor())


@contextlib.contextmanager
def session(manager: AituneManager, name: str | None = None) -> Iterator[BuildSession]:
    """Run a tune's builds on the executor ``name`` (see :func:`chosen`) of ``manager``; nested tunes keep the outer one."""
    outer = _active.get()
    if outer is not None and name is None:
        yield outer
        return
    current = BuildSession(manager.executors.create(chosen(name)), manager.registry)
    token = _active.set(current)
    try:
        yield current
    finally:
        _active.reset(token)
        current.close()


@hookimpl(specname="aitune_profile", wrapper=True)
def profile_when_quiet(runners: Any, batch_size: int, config: Any, device: Any) -> Generator[None, Any, Any]:
    """Builds submitted ahead finish before anything is timed."""
    active().wait_idle()
    return (yield)
