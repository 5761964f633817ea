"""Where isolated builds run: the executor extension point.

A build that a backend can export (see :mod:`aitune.builtin.isolation`) is a job: JSON plus the files
``export`` wrote, never a pickled module. An :class:`Executor` runs jobs. A plugin registers
executors through ``aitune_register_executors`` into the :class:`ExecutorRegistry`; core ships
``local`` (a worker process on this machine) as its own plugin, :mod:`aitune.builtin.executor`, which
also keeps each tune's builds. ``aitune-executor-ray`` runs jobs as Ray tasks.

Choose with ``ait.tune(..., executor="ray")`` or ``AITUNE_EXECUTOR=ray``; the default is ``local``.
"""

from __future__ import annotations

import abc
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from .errors import ConfigError, PluginError

if TYPE_CHECKING:
    from .backend import Backend, BuildContext

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


def chosen(name: str | None = None) -> str:
    """The executor to use: ``name``, else ``AITUNE_EXECUTOR``, else ``local``."""
    value = name if name is not None else os.environ.get("AITUNE_EXECUTOR", "").strip()
    return value.strip().lower() or DEFAULT
