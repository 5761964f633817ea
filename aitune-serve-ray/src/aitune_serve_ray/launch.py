"""``aitune serve --engine ray``: start Ray (a local instance, or join ``--address``), serve the
artifact on the Open Inference Protocol v2, and wait for Ctrl-C or SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

APP = "aitune"


def start(
    factory: str,
    artifact: str | Path,
    *,
    port: int = 8000,
    host: str = "127.0.0.1",
    address: str | None = None,
    **options: Any,
) -> str:
    """Serve ``artifact`` with ``factory`` as the Ray Serve application ``aitune``; the model's URL
    (``.../v2/models/{name}``, the name the artifact's stem unless ``name=`` says).

    Without ``address`` a local Ray starts here, its workers seeing this directory (so
    ``--factory mymodels:build`` imports from where the command runs); with it, the cluster's
    nodes must have the factory's package and the artifact's path themselves.
    """
    import ray
    from ray import serve

    from aitune.torch.serving import resolve_factory

    from .replica import deployment

    sys.path.insert(0, os.getcwd())
    resolve_factory(factory)  # fails here, with the import error, rather than in every replica
    name = options.pop("name", None) or Path(artifact).stem
    app = deployment(factory, artifact, name=name, **options)
    if not ray.is_initialized():
        if address:
            ray.init(address=address)
        else:
            path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
            ray.init(include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=APP, route_prefix="/")
    return f"http://{host}:{port}/v2/models/{name}"


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
    try:
        url = start(factory, artifact, **options)
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
