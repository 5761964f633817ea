"""Fault-injection backends: each breaks in one known way, to show what aitune survives.

The isolated ones (``native_build = True``) export a small file and then fail inside the build
worker: a segfault, an abort, a bare ``os._exit``, a hang, memory eaten until the cap, or a plain
exception. ``toy_isolated`` builds in the worker and works. ``fault_infer`` builds and validates,
then raises on the user's calls after tuning; ``fault_oom`` raises ``torch.OutOfMemoryError``
once a large batch runs repeatedly (as in profiling). Register them with
``register_plugin(aitune_testkit.faults)`` next to :mod:`aitune.testing.backends`.
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from aitune import hookimpl
from aitune.backend import BackendConfig, BuildContext
from aitune.registry import BackendRegistry
from aitune.testing.backends import ToyBackend, register


class IsolatedToyBackend(ToyBackend):
    """A toy backend that builds in a worker: the worker writes the payload ``load`` reads."""

    name = "toy_isolated"
    native_build = True

    def export(self, module: torch.nn.Module, context: BuildContext, directory: Path) -> dict[str, Any] | None:
        (directory / "module.txt").write_text(repr(module))
        return {"graph": context.graph.key}

    @classmethod
    def build_exported(
        cls, config: BackendConfig, exported: Path, notes: dict[str, Any], context: BuildContext, payload: Path
    ) -> dict[str, Any]:
        assert (exported / "module.txt").is_file(), "the worker sees the exported files"
        cls.fault()
        (payload / "toy.txt").write_text(str(config.speed))  # type: ignore[attr-defined]
        return {"speed": config.speed, "worker_pid": os.getpid()}  # type: ignore[attr-defined]

    @staticmethod
    def fault() -> None:
        """What goes wrong in the worker; nothing here."""


class SegfaultBackend(IsolatedToyBackend):
    """Reads address 0 in the worker: a real SIGSEGV."""

    name = "fault_segfault"

    @staticmethod
    def fault() -> None:
        ctypes.string_at(0)


class AbortBackend(IsolatedToyBackend):
    """Aborts the worker (SIGABRT) as an uncaught C++ exception does: its ``what():`` line first,
    then a long stack dump, as torch's compiled kernels print them."""

    name = "fault_abort"

    @staticmethod
    def fault() -> None:
        print("terminate called after throwing an instance of 'c10::Error'", file=sys.stderr)
        print("  what():  index out of bounds: 0 <= tmp2 < 256L", file=sys.stderr)
        for frame in range(40):
            print(f"frame #{frame}: 0x{frame:012x} in libtorch_cpu.so", file=sys.stderr)
        sys.stderr.flush()
        os.abort()


class RetriedAbortBackend(AbortBackend):
    """Aborts in the worker as ``fault_abort`` does, but says a build in the user's process takes
    another path (``retry_in_process``), and there it works: the compiler defect that only the
    worker's round trip hits."""

    name = "fault_abort_retried"
    retry_in_process = True


class ExitBackend(IsolatedToyBackend):
    """Leaves the worker with ``os._exit(7)`` and no result, as a library calling ``exit`` does."""

    name = "fault_exit"

    @staticmethod
    def fault() -> None:
        os._exit(7)


class HangBackend(IsolatedToyBackend):
    """Never finishes its build."""

    name = "fault_hang"

    @staticmethod
    def fault() -> None:
        while True:
            time.sleep(1)


class MemoryHogBackend(IsolatedToyBackend):
    """Takes memory in 256 MB steps until the worker's cap says no."""

    name = "fault_memory"

    @staticmethod
    def fault() -> None:
        hoard = []
        while True:
            hoard.append(bytearray(256 * 1024 * 1024))


class RaisingBackend(IsolatedToyBackend):
    """Raises an ordinary exception in the worker."""

    name = "fault_raise"

    @staticmethod
    def fault() -> None:
        raise RuntimeError("the compiler rejected the graph on purpose")


class InferFailBackend(ToyBackend):
    """Correct while aitune tunes it; raises on every call the user makes afterwards."""

    name = "fault_infer"

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        from aitune.engine import recording

        if not recording.bypassing():
            raise RuntimeError("the runtime lost its device context on purpose")
        return super().infer(*args, **kwargs)


class OutOfMemoryBackend(ToyBackend):
    """Raises ``torch.OutOfMemoryError`` when a batch above ``max_batch`` runs more than once.

    A single call at that size (validation's max-shape check) passes; the repeated calls of
    profiling do not, as when a large batch fits once but not alongside the measuring runs.
    """

    name = "fault_oom"

    def __init__(self, config: BackendConfig | None = None) -> None:
        super().__init__(config)  # type: ignore[arg-type]
        self.seen: collections.Counter[int] = collections.Counter()

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() else 1
        limit = self.config.max_batch
        if limit is None or batch <= limit:
            return super().infer(*args, **kwargs)
        self.seen[batch] += 1
        if self.seen[batch] > 1:
            raise torch.OutOfMemoryError(f"simulated: out of memory at batch {batch}")
        assert self.module is not None, "used before build"
        return self.module(*args, **kwargs)


FAULT_BACKENDS = (
    IsolatedToyBackend,
    SegfaultBackend,
    AbortBackend,
    RetriedAbortBackend,
    ExitBackend,
    HangBackend,
    MemoryHogBackend,
    RaisingBackend,
    InferFailBackend,
    OutOfMemoryBackend,
)


@hookimpl
def aitune_register_backends(registry: BackendRegistry) -> None:
    register(registry, FAULT_BACKENDS, __name__)
