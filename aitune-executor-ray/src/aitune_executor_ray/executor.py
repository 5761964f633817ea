"""The ``ray`` executor: every exported candidate build of a tune runs as a Ray task.

The user's process exports (JSON plus files, never a pickled module), submits every build right
after recording, and keeps validation and profiling to itself. Each task asks for what its build
needs: ``{"GPU": 1}`` (and this machine's GPU model, so an engine is built for the GPU it will run
on) for a CUDA build, ``AITUNE_RAY_BUILD_CPUS`` CPUs (default 1) for a CPU build. The exported
files and the payload travel through Ray's object store, or by path when ``AITUNE_RAY_SHARED_DIR``
names a folder every node mounts (large ONNX files and engines). A Ray worker that dies mid-build (node lost, killed, out of
memory) is retried once by Ray; a second death costs that candidate, never the tune.

``ray.init()`` is called only when Ray is not initialized yet, with Ray's own conventions:
``RAY_ADDRESS``, else a cluster started on this machine with ``ray start``, else a new local one.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from aitune.plugin import BuildHandle, BuildRequest, Executor, WorkerBuildError, envvars, worker_job

from . import task

logger = logging.getLogger("aitune")

BUILD_CPUS = envvars.Variable("AITUNE_RAY_BUILD_CPUS", envvars.number(above=0, what="CPUs per CPU build"), "1")
"""The CPUs a CPU build's task asks for."""
ACCELERATOR_TYPE = envvars.Variable("AITUNE_RAY_ACCELERATOR_TYPE", envvars.parse_text)
"""The GPU model a CUDA build's task asks for; unset: this node's, as Ray names it."""
SHARED_DIR = envvars.Variable("AITUNE_RAY_SHARED_DIR", envvars.parse_path)
"""A folder every node mounts; unset: files travel through Ray's object store."""
VARIABLES = (BUILD_CPUS, ACCELERATOR_TYPE, SHARED_DIR)
"""Every variable this executor reads (docs/settings.md lists them; its tests check)."""


def build_cpus() -> float:
    return BUILD_CPUS.get()


def task_resources(device: str, accelerator: str | None) -> dict[str, Any]:
    """Ray options of a build for ``device``: one GPU of this machine's model, or CPUs."""
    if device.startswith("cuda"):
        options: dict[str, Any] = {"num_cpus": 1, "num_gpus": 1}
        if accelerator:
            options["resources"] = {accelerator: 0.001}
        return options
    return {"num_cpus": build_cpus(), "num_gpus": 0}


def local_accelerator() -> str | None:
    """This node's ``accelerator_type:<GPU model>`` resource, which Ray sets on GPU nodes."""
    import ray

    override = ACCELERATOR_TYPE.get()
    if override:
        return override if override.startswith("accelerator_type:") else f"accelerator_type:{override}"
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return next((k for k in node.get("Resources", {}) if k.startswith("accelerator_type:")), None)
    return None


class _Answer(BuildHandle):
    """A build that is already decided (it cannot be scheduled anywhere)."""

    def __init__(self, error: WorkerBuildError) -> None:
        self.error = error

    def result(self) -> dict[str, Any]:
        raise self.error


def shared_dir() -> Path | None:
    """``AITUNE_RAY_SHARED_DIR``: a folder every node mounts, so files travel by path, not through Ray."""
    path = SHARED_DIR.get()
    if path is not None and not path.is_dir():
        from aitune.plugin import ConfigError

        raise ConfigError(
            f"{SHARED_DIR.name}={str(path)!r} is not a folder; create it on a filesystem every node mounts"
        )
    return path


class RayBuild(BuildHandle):
    """One build running as a Ray task."""

    def __init__(self, ref: Any, folder: Path, what: str, shared: Path | None = None) -> None:
        self.ref, self.folder, self.what, self.shared = ref, folder, what, shared

    def result(self) -> dict[str, Any]:
        import ray

        try:
            answer = ray.get(self.ref)
        except ray.exceptions.RayError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise WorkerBuildError(
                f"{self.what} was lost: the Ray worker running it died and its retry did too (a node lost, "
                f"a killed worker, or out of memory); the candidate is skipped, the tune goes on "
                f"({type(exc).__name__}: {first})",
                "crash",
            ) from None
        if not answer["ok"]:
            raise WorkerBuildError(
                f"{answer['message']}\n(on Ray node {answer['node']})",
                answer["cause"],
                answer["exit_code"],
                answer["log_tail"],
            )
        if self.shared is not None:
            shutil.copytree(self.shared / "payload", self.folder / "payload", dirs_exist_ok=True)
            shutil.rmtree(self.shared, ignore_errors=True)
        else:
            task.unpack(answer["payload"], self.folder / "payload")
        self.worker_s = float(answer["seconds"])
        metadata: dict[str, Any] = answer["metadata"]
        return metadata

    def wait(self) -> None:
        import ray

        ray.wait([self.ref], num_returns=1, fetch_local=False)

    def cancel(self) -> None:
        import ray

        ray.cancel(self.ref, force=True)
        if self.shared is not None:
            shutil.rmtree(self.shared, ignore_errors=True)


class RayExecutor(Executor):
    """Candidate builds as Ray tasks, all submitted at once."""

    name = "ray"
    concurrent = True

    def __init__(self) -> None:
        import ray

        if not ray.is_initialized():
            ray.init()  # RAY_ADDRESS, else a cluster started here with `ray start`, else a local one
        self._remote = ray.remote(max_retries=1, retry_exceptions=False)(task.build)
        self._accelerator = local_accelerator()

    def submit(self, request: BuildRequest) -> BuildHandle:
        import ray

        job = worker_job(request.backend, request.notes, request.context, request.folder)
        job["what"] = f"{request.what} in a Ray task"
        options = task_resources(job["device"], self._accelerator)
        missing = self._unschedulable(options)
        if missing:
            return _Answer(WorkerBuildError(f"{request.what} cannot run on this Ray cluster: {missing}", "exit"))
        remote = self._remote.options(name=f"aitune: {request.what}", **options)
        shared = shared_dir()
        if shared is not None:
            folder = Path(tempfile.mkdtemp(prefix="aitune-build-", dir=shared))
            shutil.copytree(request.folder / "exported", folder / "exported")
            ref = remote.remote(job, None, str(folder))
            return RayBuild(ref, request.folder, job["what"], folder)
        ref = remote.remote(job, ray.put(task.pack(request.folder / "exported")))
        return RayBuild(ref, request.folder, job["what"])

    @staticmethod
    def _unschedulable(options: dict[str, Any]) -> str | None:
        """Why no node of the cluster can take a task with ``options`` (None when one can)."""
        import ray

        wanted = {"CPU": options.get("num_cpus", 0), "GPU": options.get("num_gpus", 0), **options.get("resources", {})}
        for node in ray.nodes():
            have = node.get("Resources", {})
            if node.get("Alive") and all(have.get(k, 0) >= v for k, v in wanted.items() if v):
                return None
        needs = ", ".join(f"{k}: {v:g}" for k, v in wanted.items() if v)
        return (
            f"no node has {needs} (cluster resources: {ray.cluster_resources()}); add such a node, "
            "or build locally with AITUNE_EXECUTOR=local"
        )

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """The cluster's resources when one is reachable; starts none."""
        import ray

        connected_here = False
        if not ray.is_initialized():
            try:
                ray.init(address="auto", logging_level=logging.WARNING)
                connected_here = True
            except (ConnectionError, RuntimeError, ValueError):
                return {
                    "where": "Ray tasks",
                    "cluster": "none running (ait.tune connects to RAY_ADDRESS or starts a local one)",
                }
        try:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            resources = {
                k: v
                for k, v in ray.cluster_resources().items()
                if k in ("CPU", "GPU", "memory") or k.startswith("accelerator_type:")
            }
            return {"where": "Ray tasks", "cluster": f"{len(nodes)} node(s)", **resources}
        finally:
            if connected_here:
                ray.shutdown()
