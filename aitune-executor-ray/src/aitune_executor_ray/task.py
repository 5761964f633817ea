"""What runs on a Ray worker: one exported build, in aitune's own worker process under its limits.

The task gets the job's JSON and the exported files as bytes (through Ray's object store), writes
them into a scratch folder on its node, and runs :func:`aitune.executor.run_job` there: the same
``python -m aitune.builds.worker`` process, time limit, memory cap and crash diagnosis as a local build.
It answers with JSON-able data and the payload files as bytes (or, when ``AITUNE_RAY_SHARED_DIR``
names a folder every node mounts, leaves both the exported files and the payload there). A failed build is an answer
(``ok: False``), not an exception, so only a dead Ray worker makes Ray retry the task.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from pathlib import Path, PurePosixPath
from typing import Any


def pack(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder``, by its relative POSIX path."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def unpack(files: dict[str, bytes], folder: Path) -> None:
    """Write ``files`` under ``folder``, refusing any name that would land outside it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        path = PurePosixPath(name)
        if path.is_absolute() or not path.parts or any(part in ("", ".", "..") for part in path.parts):
            raise ValueError(f"refusing the file name {name!r}: it is not a plain relative path")
        target = folder.joinpath(*path.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def build(job: dict[str, Any], exported: dict[str, bytes] | None, shared: str | None = None) -> dict[str, Any]:
    """Run one build job on this node; returns ``{"ok", "metadata", "payload", "node"}`` or the failure.

    With ``shared`` (a folder every node mounts, holding ``exported/``) the files stay on that
    path both ways and ``payload`` is None.
    """
    from aitune.plugin import WorkerBuildError, job_on_this_node, run_job

    node = socket.gethostname()
    folder = Path(shared) if shared else Path(tempfile.mkdtemp(prefix="aitune-ray-build-"))
    try:
        if exported is not None:
            unpack(exported, folder / "exported")
        local = job_on_this_node(job, folder)
        start = time.perf_counter()
        try:
            metadata = run_job(local, folder)
        except WorkerBuildError as exc:
            return {
                "ok": False,
                "message": str(exc),
                "cause": exc.cause,
                "exit_code": exc.exit_code,
                "log_tail": exc.log_tail,
                "node": node,
            }
        seconds = time.perf_counter() - start
        payload = None if shared else pack(folder / "payload")
        return {"ok": True, "metadata": metadata, "payload": payload, "node": node, "seconds": seconds}
    finally:
        if not shared:
            shutil.rmtree(folder, ignore_errors=True)
