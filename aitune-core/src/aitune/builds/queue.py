"""The builds of one tune, and core's executor plugin (it registers ``local``).

``local`` (:class:`aitune.builds.isolation.LocalExecutor`) runs each exported build in a worker
process on this machine: beside the tune where the tune's threads leave cores spare, else when a
strategy asks for it. A :class:`TuneBuildQueue` holds one ``ait.tune``'s executor and, for an executor that runs
builds side by side (``concurrent``), every build of the pipeline submitted right after
recording; the strategies then take the results in their own order.

Validation and profiling stay in the user's process, one at a time, and profiling waits until no
build is in flight, because timings taken next to a compiler are worthless.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from .. import hookimpl
from ..executor import (
    DEFAULT,
    BuildHandle,
    BuildRequest,
    Executor,
    ExecutorRegistrar,
    ExecutorRegistry,
    ExecutorSpec,
    chosen,
)
from ..session import Session
from . import isolation

if TYPE_CHECKING:
    import torch

    from ..backend import Backend, BuildContext
    from ..registry import BackendRegistry

logger = logging.getLogger("aitune")


@hookimpl
def aitune_register_executors(registry: ExecutorRegistrar) -> None:
    registry.add(
        ExecutorSpec(
            name=DEFAULT,
            executor_class="aitune.builds.isolation:LocalExecutor",
            description="worker processes on this machine, beside the tune where cores are spare",
        )
    )


# -- one tune's builds --------------------------------------------------------------------------


@attrs.define
class _Ahead:
    request: BuildRequest
    handle: BuildHandle


class TuneBuildQueue:
    """The builds of one ``ait.tune`` (its :class:`~aitune.executor.BuildQueue`): its executor and the
    builds submitted ahead, by build key."""

    def __init__(self, executor: Executor, registry: BackendRegistry | None = None) -> None:
        self.executor = executor
        self.registry = registry  # build keys name each backend's distribution; None: nothing is sent ahead
        self._ahead: dict[str, _Ahead] = {}
        self._root: Path | None = None

    def folder(self) -> Path:
        """A fresh folder for one build, removed when the tune ends."""
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="aitune-builds-"))
        return Path(tempfile.mkdtemp(dir=self._root))

    def beside(self, backend: Backend) -> bool:
        """Whether ``backend``'s build runs in a worker beside the tune: this executor runs builds side
        by side and the backend builds isolated (the builds :func:`aitune.engine.fanout.submit_ahead` sends)."""
        return self.executor.concurrent and isolation.isolated(backend)

    def submit_ahead(self, backend: Backend, module: torch.nn.Module, context: BuildContext) -> bool:
        """Export ``backend``'s build now and hand it to the executor; False when it is not one to send.

        Builds that do not run in a worker, cache hits and failed exports are left to the strategy,
        which builds (and reports) them the usual way.
        """
        from ..builtin import buildcache

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
        from ..builtin import buildcache

        try:
            ahead = self._ahead.pop(buildcache.build_key(backend, module, context, self.registry), None)
        except Exception:
            return None
        return (ahead.request, ahead.handle) if ahead is not None else None

    def wait_idle(self) -> None:
        """Wait until no build submitted ahead is running (before profiling)."""
        for ahead in self._ahead.values():
            ahead.handle.wait()

    def pending(self) -> bool:
        """Whether builds submitted ahead are not taken yet (some may still run)."""
        return bool(self._ahead)

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


@contextlib.contextmanager
def build_queue(
    executors: ExecutorRegistry, registry: BackendRegistry, name: str | None = None
) -> Iterator[TuneBuildQueue]:
    """One tune's builds on the executor ``name`` (see :func:`chosen`), closed when the tune ends."""
    current = TuneBuildQueue(executors.create(chosen(name)), registry)
    try:
        yield current
    finally:
        current.close()


@hookimpl(specname="aitune_profile", wrapper=True)
def profile_when_quiet(session: Session) -> Generator[None, Any, Any]:
    """Builds submitted ahead finish before anything is timed."""
    if session.builds is not None:
        session.builds.wait_idle()
    return (yield)
