"""Where isolated builds run: the executor extension point, and the worker job every executor runs.

A build that a backend can export (see :mod:`aitune.builds.isolation`) is a job: JSON plus the files
``export`` wrote, never a pickled module (:func:`worker_job`). An :class:`Executor` runs jobs,
each in ``python -m aitune.builds.worker`` (:func:`run_job`) wherever it chooses. A plugin's
``aitune_register_executors`` hook declares executors through the :class:`ExecutorRegistrar` it is
handed, into the manager's :class:`ExecutorRegistry`; core ships ``local`` (a worker process on this
machine) in :mod:`aitune.builds.local`. ``aitune-executor-ray`` runs jobs as Ray tasks, using only
what this module makes public.

Choose with ``ait.tune(..., executor="ray")`` or ``AITUNE_EXECUTOR=ray``; the default is ``local``.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import attrs

from . import envvars
from .converter import unstructure
from .errors import BuildError, ConfigError, PluginError

if TYPE_CHECKING:
    import torch

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

        Raises :class:`WorkerBuildError` when the build failed or its worker died.
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
    concurrent: bool = False
    """True when submitted builds run side by side (with each other and with the user's process),
    so submitting them all ahead pays off; an executor may decide it per instance."""

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


class BuildQueue(Protocol):
    """One run's builds, as the isolation plugin and profiling see them (``Session.builds``)."""

    executor: Executor

    def take(
        self, backend: Backend, module: torch.nn.Module, context: BuildContext
    ) -> tuple[BuildRequest, BuildHandle] | None:
        """The build of ``backend`` submitted ahead for this module and graph, if any."""

    def wait_idle(self) -> None:
        """Wait until no build submitted ahead is running (before anything is timed)."""

    def pending(self) -> bool:
        """Whether builds submitted ahead are not taken yet (some may still run)."""

    def folder(self) -> Path:
        """A fresh folder for one build, removed when the run ends."""

    def beside(self, backend: Backend) -> bool:
        """Whether ``backend``'s build runs in a worker beside the run (the builds sent ahead)."""

    def submit_ahead(self, backend: Backend, module: torch.nn.Module, context: BuildContext) -> bool:
        """Export ``backend``'s build now and hand it to the executor; False when it is not one to send."""


# -- the registry -------------------------------------------------------------------------------


def _requirements(values: Iterable[str]) -> tuple[str, ...]:
    """The attrs converter of :attr:`ExecutorSpec.requirements`: ``tuple`` itself would leave mypy
    the field's ``__init__`` parameter as an iterable of an unsolved type."""
    return tuple(values)


@attrs.frozen(kw_only=True)
class ExecutorSpec:
    """What a plugin declares about one executor."""

    name: str = attrs.field(validator=attrs.validators.matches_re(r"^[a-z][a-z0-9_\-]*$"))
    executor_class: str
    """``"package.module:ClassName"`` of the :class:`Executor` subclass, imported only when used."""
    requirements: tuple[str, ...] = attrs.field(default=(), converter=_requirements)
    """PEP 508 strings of the libraries it needs (``"ray>=2.9"``)."""
    description: str = ""


class ExecutorRegistry:
    """Every executor the loaded plugins declared, by name."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[ExecutorSpec, str]] = {}

    def add(self, spec: ExecutorSpec, *, distribution: str = "unknown") -> None:
        """Declare an executor of ``distribution``; plugins call this through their :class:`ExecutorRegistrar`."""
        if not isinstance(spec, ExecutorSpec):
            raise PluginError(f"{distribution} registered {spec!r}, which is not an ExecutorSpec")
        if spec.name in self._entries:
            raise PluginError(
                f"executor {spec.name!r} is registered by both {self._entries[spec.name][1]} and "
                f"{distribution}; uninstall one of them"
            )
        self._entries[spec.name] = (spec, distribution)

    def remove(self, name: str) -> None:
        """Forget the executor ``name`` (a registration that failed half-way takes back what it added)."""
        self._entries.pop(name, None)

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
        from .registry import import_path

        cls = import_path(self.spec(name).executor_class)
        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise PluginError(f"{self.spec(name).executor_class} is not an aitune Executor class")
        return cls

    def create(self, name: str) -> Executor:
        reason = self.reason(name)
        if reason:
            raise ConfigError(f"the {name} executor cannot run here: {reason}")
        return self.executor_class(name)()


@attrs.frozen
class ExecutorRegistrar:
    """The ``registry`` that one plugin's ``aitune_register_executors`` hook is handed: bound to the
    plugin's distribution, so its executors are recorded as theirs, and able to take them back
    when the registration fails (:meth:`rollback`)."""

    registry: ExecutorRegistry
    distribution: str
    added: list[str] = attrs.field(factory=list, init=False)
    """The names this plugin declared, in order."""

    def add(self, spec: ExecutorSpec) -> None:
        """Declare one executor of this plugin; a name already declared is refused."""
        self.registry.add(spec, distribution=self.distribution)
        self.added.append(spec.name)

    def rollback(self) -> None:
        """Take back every executor this plugin declared."""
        for name in reversed(self.added):
            self.registry.remove(name)
        self.added.clear()


def chosen(name: str | None = None) -> str:
    """The executor to use: ``name``, else ``AITUNE_EXECUTOR``, else ``local`` (in lower case)."""
    return (name or "").strip().lower() or envvars.EXECUTOR.get()


# -- the worker job: what every executor runs ---------------------------------------------------

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_JOB = 2
EXIT_OUT_OF_MEMORY = 3
"""The worker's exit codes."""
LOG_LINES = 20


class WorkerBuildError(BuildError):
    """An isolated build failed; ``cause`` is ``crash``, ``timeout``, ``memory``, ``exit`` or ``error``."""

    def __init__(self, message: str, cause: str, exit_code: int | None = None, log_tail: str = "") -> None:
        super().__init__(message)
        self.cause = cause
        self.exit_code = exit_code
        self.log_tail = log_tail


def timeout_s() -> float:
    """A worker's time limit in seconds: ``AITUNE_BUILD_TIMEOUT_S``."""
    return envvars.BUILD_TIMEOUT_S.get()


def memory_mb(device: torch.device) -> int | None:
    """The worker's address-space cap in MB, or None for no cap."""
    default = None
    if device.type == "cpu":
        try:
            default = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 3 // 4 // (1024 * 1024)
        except (ValueError, OSError, AttributeError):
            default = None
    chosen = envvars.BUILD_MEMORY_MB.get()
    value = default if chosen is None else chosen
    return int(value) if value else None


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def worker_job(backend: Backend, notes: dict[str, Any], context: BuildContext, folder: Path) -> dict[str, Any]:
    """The JSON a worker builds from: names, config, graph and folders, never a pickled object."""
    return {
        "backend": backend.name,
        "backend_class": _class_path(type(backend)),
        "config": unstructure(backend.config),
        "graph": unstructure(context.graph),
        "device": str(context.device),
        "notes": notes,
        "cache_dir": str(context.cache_dir),
        "module_name": context.module_name,
        "memory_mb": memory_mb(context.device),
        "timeout_s": timeout_s(),
        "what": f"{backend.name} build of {context.module_name or 'the module'} in a worker process",
        **folders(folder),
    }


def folders(folder: Path) -> dict[str, str]:
    """The job's paths inside ``folder``: another machine rewrites them for its own copy."""
    return {
        "exported": str(folder / "exported"),
        "payload": str(folder / "payload"),
        "workdir": str(folder),
        "result": str(folder / "result.json"),
    }


def run_worker(
    backend: Backend,
    notes: dict[str, Any],
    context: BuildContext,
    folder: Path,
    started: Callable[[subprocess.Popen[bytes]], None] | None = None,
) -> dict[str, Any]:
    """Run ``build_exported`` for ``backend`` in a worker; returns the payload's metadata or raises."""
    return run_job(worker_job(backend, notes, context, folder), folder, started)


def run_job(
    job: dict[str, Any], folder: Path, started: Callable[[subprocess.Popen[bytes]], None] | None = None
) -> dict[str, Any]:
    """Run one job (see :func:`worker_job`) in ``python -m aitune.builds.worker`` under its time limit.

    ``started`` gets the worker process as soon as it runs, so whoever waits in another thread can
    stop it (:func:`stop`)."""
    limit, cap, what = float(job["timeout_s"]), job.get("memory_mb"), job["what"]
    result, log = Path(job["result"]), folder / "worker.log"
    job_path = folder / "job.json"
    job_path.write_text(json.dumps({**job, "parent_pid": os.getpid()}, default=str))
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aitune.builds.worker", str(job_path)],
            env={**os.environ, "AITUNE_JIT": "0"},  # a build worker builds; it never tunes modules itself
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout stops the worker and its children
        )
        if started is not None:
            started(proc)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise WorkerBuildError(
                f"{what} did not finish within {limit:g} s and was stopped; if the build is only slow, raise "
                f"AITUNE_BUILD_TIMEOUT_S{_tail_text(log)}",
                "timeout",
                None,
                _tail(log),
            ) from None
        except BaseException:  # Ctrl-C while waiting: take the worker down with us
            _stop(proc)
            raise
    return _outcome(what, code, result, log, cap)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    stop(proc)
    proc.wait()


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Kill a worker and its children (its process group), without waiting for it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _outcome(what: str, code: int, result: Path, log: Path, cap: int | None) -> dict[str, Any]:
    tail = _tail(log)
    answer: dict[str, Any] = {}
    if result.is_file():
        try:
            answer = json.loads(result.read_text())
        except ValueError:
            answer = {}
    if code == 0 and answer.get("ok"):
        return dict(answer.get("metadata") or {})
    cap_text = f"{cap} MB" if cap else "none"
    if code == EXIT_OUT_OF_MEMORY or _says_out_of_memory(answer, tail):
        raise WorkerBuildError(
            f"{what} ran out of memory (address-space cap {cap_text}, AITUNE_BUILD_MEMORY_MB); raise the cap, "
            f"free memory, or build with a smaller max batch{_tail_text(log)}",
            "memory",
            code,
            tail,
        )
    if code < 0:
        name = _signal_name(-code)
        hint = " (the kernel's out-of-memory killer sends this too)" if -code == signal.SIGKILL else ""
        raise WorkerBuildError(
            f"{what} crashed with {name}{hint}; the candidate is skipped and your process is unharmed. "
            f"Report it to the backend's authors with the log{_tail_text(log)}",
            "crash",
            code,
            tail,
        )
    if answer.get("ok") is False:
        raise WorkerBuildError(
            f"{what} failed: {answer.get('error')}: {answer.get('message')}{_tail_text(log)}", "error", code, tail
        )
    why = "could not read its job" if code == EXIT_BAD_JOB else "exited without a result"
    raise WorkerBuildError(f"{what} {why} (exit code {code}){_tail_text(log)}", "exit", code, tail)


def _says_out_of_memory(answer: dict[str, Any], tail: str) -> bool:
    text = f"{answer.get('error', '')} {answer.get('message', '')}".lower()
    return answer.get("error") == "MemoryError" or "can't allocate memory" in text or "out of memory" in text


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


KEY_LINES = ("what():", "terminate called", "Error:", "error:", "Assertion", "Aborted")
"""Lines worth keeping wherever they are in a worker's log: a native crash prints its cause (a C++
exception's ``what():``) long before the interpreter's stack dump that ends the log."""


def _tail(log: Path) -> str:
    """The log's last lines, after the key lines that came before them (at most ``LOG_LINES`` of those)."""
    try:
        with open(log, errors="replace") as f:
            last: deque[str] = deque(maxlen=LOG_LINES)
            key: deque[str] = deque(maxlen=LOG_LINES)
            for line in f:
                if len(last) == LOG_LINES and any(k in last[0] for k in KEY_LINES):
                    key.append(last[0])
                last.append(line)
    except OSError:
        return ""
    earlier = "".join(key)
    return (f"{earlier}[...]\n" if earlier else "") + "".join(last).rstrip()


def _tail_text(log: Path) -> str:
    tail = _tail(log)
    return f"\nlast lines of the worker's log:\n{tail}" if tail else ""


def job_on_this_node(job: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``job`` as another machine runs it: its paths in ``folder``, this machine's cache and memory cap."""
    from .cachedir import cache_dir

    local = {**job, **folders(folder), "cache_dir": str(cache_dir())}
    if envvars.BUILD_MEMORY_MB.text() is None:  # the cap follows this machine's memory
        import torch

        local["memory_mb"] = memory_mb(torch.device(job["device"]))
    return local
