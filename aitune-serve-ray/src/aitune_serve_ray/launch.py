"""``aitune serve --engine ray``: start Ray (a local instance, or join ``--address``), serve the
artifact on the Open Inference Protocol v2, and wait for Ctrl-C or SIGTERM."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import warnings
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
    on_warning: Callable[[str], None] | None = None,
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
    Serve gives up on them; the application is deleted. So does a cluster that refuses this
    process's Ray auth token (or its lack of one), at once rather than after Ray's 20 s of retries.

    Ray Serve already running on the cluster keeps the HTTP host and port it started with: the URL
    is then the one Serve listens on, and ``on_warning`` (default: a :class:`RuntimeWarning`) says
    that ``port`` was not applied.
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
    started_here = False  # a Ray of this process's own: nothing will ever add CPUs to it
    if not ray.is_initialized():
        # the replicas' and Serve's logs stay in Ray's session folder (printed below), not on this
        # terminal: a replica that fails to start would print Ray's tracebacks before the one line
        # that says why
        if address:
            try:
                _ask_gcs_once(address)
                context = ray.init(address=address, log_to_driver=False)
            except Exception as exc:
                reason = _token_advice(address, exc)
                if reason is None:
                    raise
                raise ServeStartError(f"{artifact} could not be served: {reason}") from None
        else:
            path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
            started_here = True
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
    warn = on_warning or _runtime_warning
    short = _cpus_short(app, float(ray.cluster_resources().get("CPU", 0)))
    if short is not None:
        if started_here:
            raise ServeStartError(f"{artifact} could not be served: {short}")
        warn(f"{short}; the replicas that do not fit wait until the cluster has the CPUs")
    serve.start(http_options={"host": host, "port": port})
    host, port = _serve_http(host, port, warn)
    try:
        serve.run(app, name=APP, route_prefix="/")
    except RuntimeError as exc:  # Ray Serve's "Deploying application aitune failed", the reason elsewhere
        reason = _replicas_error(APP) or str(exc).splitlines()[0]
        with contextlib.suppress(Exception):  # on a cluster, the failed application would stay listed
            serve.delete(APP)
        where = f" (the replicas' logs: {logs})" if logs else ""
        raise ServeStartError(f"{artifact} could not be served: {reason}{where}") from None
    return f"http://{host}:{port}/v2/models/{name}"


def _cpus_short(app: Any, cpus: float) -> str | None:
    """Why ``app``'s replicas (each asking Ray for as many CPUs as it runs threads) cannot all be
    placed on a Ray of ``cpus`` CPUs, with the options that fit; None when they can. Autoscaled, the
    replicas it starts with count. Ray Serve waits for CPUs that never come without a word."""
    bound = getattr(app, "_bound_deployment", None)  # the Deployment a serve.Application binds
    replicas = getattr(bound, "num_replicas", None)
    autoscaling = getattr(getattr(bound, "_deployment_config", None), "autoscaling_config", None)
    if autoscaling is not None:
        replicas = getattr(autoscaling, "initial_replicas", None) or getattr(autoscaling, "min_replicas", None)
    per = float((getattr(bound, "ray_actor_options", None) or {}).get("num_cpus") or 0)
    if not isinstance(replicas, int) or per <= 0 or replicas * per <= cpus:
        return None
    fits, threads = int(cpus // per), int(cpus // replicas)
    fixes = [f"--threads {threads}"] if 1 <= threads < per else []
    fixes += [f"--replicas {fits}"] if 1 <= fits < replicas else []
    one = replicas == 1
    return (
        f"{replicas} replica{'' if one else 's'} of {per:g} CPUs{'' if one else ' each'} (its torch threads) "
        f"need{'s' if one else ''} {replicas * per:g} CPUs and this Ray has {cpus:g}: "
        + (f"pass {' or '.join(fixes)}" if fixes else "run it on a Ray with more CPUs")
    )


def _ask_gcs_once(address: str) -> None:
    """Raises Ray's ``AuthenticationError`` at once if the GCS at ``address`` (``host:port``)
    refuses this process's token (or its lack of one): ``ray.init`` retries that for about 20 s,
    then raises a ``ConnectionError`` with a long traceback, where one direct call answers in
    milliseconds. Only a port that accepts a TCP connection within 2 s is asked (an unreachable one
    is left to ``ray.init``'s own wait), through Ray's GCS client where this Ray version has it;
    any other outcome is left to ``ray.init``."""
    host, sep, port = address.rpartition(":")
    if not sep or "/" in address or not port.isdigit():  # "auto", "ray://...": ray.init's to resolve
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
        from ray._raylet import GcsClient  # type: ignore[attr-defined]  # compiled, no stub
        from ray.exceptions import AuthenticationError
    except (OSError, ValueError, ImportError):  # unreachable, or another Ray: ray.init's error then
        return
    try:
        GcsClient(address=address)
    except AuthenticationError:
        raise
    except Exception:  # reachable but not answering as a GCS: ray.init reports it as it does
        return


def _token_advice(address: str, exc: BaseException) -> str | None:
    """The one line that says what to set, if Ray's ``AuthenticationError`` is ``exc`` or what
    caused it (ray.init wraps it in ``ConnectionError``); None for any other error."""
    try:
        from ray.exceptions import AuthenticationError
    except ImportError:  # a Ray without token authentication
        return None
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, AuthenticationError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    said = str(getattr(cause, "message", "") or "").strip().rstrip(".")
    said = f" (Ray: {said})" if said else ""
    where = "RAY_AUTH_TOKEN (or a file named by RAY_AUTH_TOKEN_PATH; default ~/.ray/auth_token)"
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return (
            f"the Ray cluster at {address} requires Ray's auth token{said}: "
            f"set RAY_AUTH_MODE=token and the cluster's token in {where}"
        )
    return f"the Ray cluster at {address} refused this process's auth token{said}: set the cluster's token in {where}"


def _runtime_warning(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _serve_http(host: str, port: int, warn: Callable[[str], None]) -> tuple[str, int]:
    """The host and port Ray Serve's proxies listen on, which are the requested ones unless Serve
    already ran on the cluster (``serve.start`` then keeps its own and only logs it). Ray has no
    public getter of the HTTP options in effect: the Serve client's ``http_config`` is read, and a
    Ray without it gets the requested port back with a warning that it could not be checked."""
    try:
        from ray.serve.context import _get_global_client

        client = _get_global_client()
        if client is None:  # raises rather than returns None, as called: just in case
            raise RuntimeError("no Serve controller found")
        config = client.http_config
        actual_host, actual_port = str(config.host), int(config.port)
    except Exception as exc:  # a Ray version without that client or field
        warn(
            f"could not check which HTTP port Ray Serve listens on ({type(exc).__name__}: {exc}); "
            f"the URL assumes port {port}, which Serve ignores if it already ran on this cluster"
        )
        return host, port
    ignored = [f"port {port}"] if actual_port != port else []
    ignored += [f"host {host}"] if actual_host != host else []
    if ignored:
        warn(
            f"Ray Serve already runs on this cluster on {actual_host}:{actual_port}, which it keeps: "
            f"{' and '.join(ignored)} not applied (only restarting Serve there, which takes every "
            "application down, changes them)"
        )
    # a Serve on every interface answers on the requested host too
    return (host if actual_host in ("0.0.0.0", "::") else actual_host), actual_port


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


def _print_warning(message: str) -> None:
    """The command's warnings: one line on stderr, as its errors (``error: ...``)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


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
        url = start(factory, artifact, on_ray_started=ours_again, on_warning=_print_warning, **options)
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
