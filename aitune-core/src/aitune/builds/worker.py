"""The worker process of an isolated build: ``python -m aitune.builds.worker JOB.json``.

It caps its own address space first, then turns the files a backend's ``export`` wrote into a
payload with ``Backend.build_exported``. It gets only JSON (backend name and class path, config,
graph, device, folders) and files, never a pickled module, and answers with a JSON result file.
A crash here (segfault, abort, out of memory) ends this process, never the user's.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import resource
import sys
import traceback
from pathlib import Path
from typing import Any

from ..executor import EXIT_BAD_JOB, EXIT_FAILED, EXIT_OK, EXIT_OUT_OF_MEMORY


def _cap_memory(megabytes: int | None) -> None:
    if megabytes:
        limit = megabytes * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _die_with_parent(parent_pid: int | None) -> None:
    """Ask Linux to end this worker when the process that started it dies (a killed Ray worker,
    a user's process stopped with SIGKILL), so no orphaned build keeps a GPU busy."""
    if not parent_pid or not sys.platform.startswith("linux"):
        return
    import ctypes
    import os
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(EXIT_FAILED)


def _backend_class(job: dict[str, Any]) -> Any:
    from ..backend import Backend

    module_name, _, qualname = job["backend_class"].partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Backend)) or obj.name != job["backend"]:
        raise TypeError(f"{job['backend_class']} is not the Backend class of {job['backend']!r}")
    return obj


def _build(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from ..backend import BuildContext
    from ..converter import structure
    from ..graph import GraphSpec

    cls = _backend_class(job)
    config = structure(job["config"], cls.config_class, "config")
    graph = structure(job["graph"], GraphSpec, "graph")
    context = BuildContext(
        graph, [], torch.device(job["device"]), Path(job["workdir"]), Path(job["cache_dir"]), job["module_name"]
    )
    payload = Path(job["payload"])
    payload.mkdir(parents=True, exist_ok=True)
    metadata = cls.build_exported(config, Path(job["exported"]), job["notes"], context, payload)
    json.dumps(metadata)  # the parent must be able to read it back
    return metadata or {}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    faulthandler.enable()  # a segfault prints the Python stack into the log the parent reads
    try:
        job = json.loads(Path(argv[0]).read_text())
        result_path = Path(job["result"])
        _die_with_parent(job.get("parent_pid"))
        _cap_memory(job.get("memory_mb"))
    except Exception as exc:
        print(f"aitune worker: unusable job ({type(exc).__name__}: {exc})", file=sys.stderr)
        return EXIT_BAD_JOB
    try:
        metadata = _build(job)
    except MemoryError:
        # drop the frames that hold the memory before doing anything that allocates
        sys.last_traceback = None
        print("aitune worker: out of memory", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    except BaseException as exc:
        traceback.print_exc()
        result = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        result_path.write_text(json.dumps(result))
        return EXIT_FAILED
    result_path.write_text(json.dumps({"ok": True, "metadata": metadata}))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
