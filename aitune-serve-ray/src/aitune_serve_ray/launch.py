"""``aitune serve --engine ray``: start Ray (a local instance, or join ``--address``), serve the
artifact on the Open Inference Protocol v2, and wait for Ctrl-C or SIGTERM."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

APP = "aitune"
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception)): (.+)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def start(
    factory: str,
    artifact: str | Path,
    *,
    port: int = 8000,
    host: str = "127.0.0.1",
    address: str | None = None,
    metrics_port: int | None = None,
    dashboard_port: int | None = None,
    on_ray_started: Callable[[], None] = lambda: None,
    **options: Any,
) -> str:
    """Serve ``artifact`` with ``factory`` as the Ray Serve application ``aitune``; the model's URL
    (``.../v2/models/{name}``, the name the artifact's stem unless ``name=`` says).

    Without ``address`` a local Ray starts here, its workers seeing this directory (so
    ``--factory mymodels:build`` imports from where the command runs); with it, the cluster's
    nodes must have the factory's package and the artifact's path themselves. A local Ray exports
    its Prometheus metrics on ``metrics_port`` (None: a free port Ray picks; either way printed at
    start) and runs its dashboard on ``dashboard_port`` when given, so ``serve status`` and the
    dashboard's Serve page work; a cluster's own settings stand.

    A model the replicas cannot load (the artifact refused, the factory or the warm-up call raising)
    raises :class:`~aitune.torch.serving.ServeStartError` with the replicas' own error, once Ray
    Serve gives up on them; the application is deleted.
    """
    import ray
    from ray import serve

    from aitune.torch.serving import ServeStartError, resolve_factory

    from .replica import deployment

    sys.path.insert(0, os.getcwd())
    resolve_factory(factory)  # fails here, with the import error, rather than in every replica
    name = options.pop("name", None) or Path(artifact).stem
    app = deployment(factory, artifact, name=name, **options)
    logs = ""
    if not ray.is_initialized():
        # the replicas' and Serve's logs stay in Ray's session folder (printed below), not on this
        # terminal: a replica that fails to start would print Ray's tracebacks before the one line
        # that says why
        if address:
            context = ray.init(address=address, log_to_driver=False)
        else:
            path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
            context = ray.init(
                include_dashboard=dashboard_port is not None,
                dashboard_port=dashboard_port,
                _metrics_export_port=metrics_port,  # ray.init's documented Prometheus port (ray start's flag)
                log_to_driver=False,
                runtime_env={"env_vars": {"PYTHONPATH": path}},
            )
        on_ray_started()
        info = getattr(context, "address_info", None) or {}  # a Ray Client context (ray://) has none
        folder = info.get("session_dir")
        logs = f"{folder}/logs" if folder else ""
        if logs:
            print(f"Ray's logs (the replicas', Serve's): {logs}", flush=True)
        if info.get("metrics_export_port"):
            print(
                f"Prometheus metrics (Ray's, Serve's, aitune's): http://127.0.0.1:{info['metrics_export_port']}/metrics"
            )
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(app, name=APP, route_prefix="/")
    except RuntimeError as exc:  # Ray Serve's "Deploying application aitune failed", the reason elsewhere
        reason = _replicas_error(APP) or str(exc).splitlines()[0]
        with contextlib.suppress(Exception):  # on a cluster, the failed application would stay listed
            serve.delete(APP)
        where = f" (the replicas' logs: {logs})" if logs else ""
        raise ServeStartError(f"{artifact} could not be served: {reason}{where}") from None
    return f"http://{host}:{port}/v2/models/{name}"


def _replicas_error(app: str) -> str | None:
    """What the replicas' constructor raised, from the deployment status Ray Serve keeps (its
    message ends with the replica's traceback): ``Type: first line of the message``."""
    from ray import serve

    try:
        deployments = serve.status().applications[app].deployments.values()
    except Exception:  # no status to read: the caller says what Ray said
        return None
    for status in deployments:
        lines = [line.strip() for line in _ANSI.sub("", status.message or "").splitlines()]
        for line in reversed(lines):
            found = _EXCEPTION_LINE.match(line)
            if found:
                return f"{found.group(1)}: {found.group(2)}"
    return None


def serve_until_interrupted(factory: str, artifact: str | Path, **options: Any) -> None:
    """:func:`start`, then block until Ctrl-C or SIGTERM, then take the application down (a local Ray
    stops with this process; on a cluster the application is deleted).

    The signals set a flag instead of raising ``KeyboardInterrupt`` inside whatever Ray is doing
    (a CI run once saw the process keep serving for three minutes after a Ctrl-C sent while
    ``serve.run`` was still returning). A signal during start-up stops the server once it is up; a
    second one exits at once.
    """
    from ray import serve

    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if stop.is_set():
            os._exit(128 + signum)
        stop.set()

    handled = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    previous = {signum: signal.signal(signum, on_signal) for signum in handled}

    def ours_again() -> None:
        # ray.init installs its own SIGTERM handler in this process, which ends it with status 15 (a
        # container's stop would drop the requests in flight): ours goes back in front of it
        for signum in handled:
            signal.signal(signum, on_signal)

    try:
        url = start(factory, artifact, on_ray_started=ours_again, **options)
        if not stop.is_set():
            print(f"serving {artifact} at {url} (Open Inference Protocol v2); Ctrl-C or SIGTERM stops", flush=True)
        while not stop.wait(1.0):
            pass
        print("stopping: taking the application down (Ctrl-C again exits at once)", flush=True)
        with contextlib.suppress(Exception):  # stopping anyway: a Serve that never started has nothing to delete
            serve.delete(APP)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
