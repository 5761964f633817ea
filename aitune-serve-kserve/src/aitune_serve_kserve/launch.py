"""``aitune serve``: load the artifact, then run kserve's ``ModelServer`` until SIGTERM or Ctrl-C.

The server is kserve's own: its REST (and, with ``grpc_port``, gRPC) Open Inference Protocol
endpoints, health and readiness, Prometheus metrics at ``/metrics`` and its graceful shutdown
(uvicorn stops accepting, answers what is in flight within ``grace_s``, then the process exits 0).
Three things are configured that ``ModelServer`` offers no argument for: the address the REST server
listens on (kserve binds every interface), limits on request bodies (:mod:`.limits`: a size cap
while the body streams, a read timeout), and a request that is not the protocol at all (a body its
decoder fails on with a ``ValueError``), which is answered 400 with what to send, not 500.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aitune.torch as ait
from aitune.torch.serving import AituneError, Factory, ServeStartError, resolve_factory

from ._kserve import ModelServer, rest_app
from .batching import Batcher, request_company
from .limits import MAX_BODY_BYTES, READ_TIMEOUT_S, BodyLimits
from .model import TunedModel
from .protocol import ProtocolDataPlane, add_unprocessable_handler


class _Server(ModelServer):
    """kserve's ``ModelServer``, its REST server listening on ``host`` and reading bodies within
    ``limits`` (:class:`BodyLimits`' keyword arguments)."""

    def __init__(self, host: str, limits: Mapping[str, Any], **options: Any) -> None:
        super().__init__(**options)
        self.host = host
        self.limits = dict(limits)
        self.dataplane = ProtocolDataPlane(model_registry=self.registered_models)

    def setup_event_loop(self) -> None:
        # start() has made the REST server (its uvicorn config binds 0.0.0.0) and not yet started it;
        # the app it will serve is kserve's module-level FastAPI, middleware still open to additions
        if self._rest_server is not None:
            self._rest_server.config.host = self.host
            rest_app.add_middleware(BodyLimits, **self.limits)
            add_unprocessable_handler(rest_app)
            rest_app.router.on_startup.append(_second_signal_exits)
            self._tell_company()
        super().setup_event_loop()

    def _tell_company(self) -> None:
        company = request_company(self._rest_server, grpc=self.enable_grpc)
        if company is None:
            return
        for model in self.registered_models.get_models().values():
            batcher = getattr(model, "batcher", None)
            if isinstance(batcher, Batcher):
                batcher.company = company


_DRAINING: list[int] = []
"""The signal that started the drain, once one has."""


def _second_signal_exits() -> None:
    """A startup handler of the REST app, so it runs inside uvicorn's ``serve()`` with uvicorn's own
    signal handlers in place: the first SIGTERM or SIGINT still drains (theirs), a second one during
    the drain exits at once with status 128 + its number, as the Ray engine's does (uvicorn alone
    forces a stop only on a second SIGINT, and the process then still waits for the model's call)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGINT, signal.SIGTERM):
        drains = signal.getsignal(signum)
        if not callable(drains):
            continue

        def handler(sig: int, frame: Any, drains: Any = drains) -> None:
            if _DRAINING:
                os._exit(128 + sig)
            _DRAINING.append(sig)
            print("stopping: answering the requests in flight (a second signal exits at once)", flush=True)
            drains(sig, frame)

        signal.signal(signum, handler)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[list[int]]:
    """While the model loads (before kserve's server handles signals), SIGTERM and SIGINT are noted,
    not fatal: the load finishes and the process exits 0 without serving. A second one exits at once."""
    noted: list[int] = []

    def note(signum: int, frame: Any) -> None:
        if noted:
            os._exit(128 + signum)
        noted.append(signum)

    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    previous = {signum: signal.signal(signum, note) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield noted
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def serve(
    factory: Factory | str,
    artifact: str | Path,
    *,
    name: str | None = None,
    **options: Any,
) -> None:
    """Serve ``artifact`` loaded into ``factory()`` as model ``name`` (default: the artifact's stem)
    until SIGTERM or Ctrl-C; in-flight requests are answered first. ``options`` are
    :func:`serve_models`'."""
    serve_models([(factory, artifact, name)], **options)


def serve_models(
    models: Sequence[tuple[Factory | str, str | Path, str | None]],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    grpc_port: int | None = None,
    threads: int | None = None,
    eager: bool = False,
    max_rows: int | None = None,
    pad: Mapping[str, float] | None = None,
    grace_s: int = 30,
    max_body_bytes: int = MAX_BODY_BYTES,
    read_timeout_s: float = READ_TIMEOUT_S,
    load_options: ait.LoadOptions | Mapping[str, Any] | None = None,
) -> None:
    """Serve each ``(factory, artifact, name)`` (a None name: the artifact's stem) in one server until
    SIGTERM or Ctrl-C; in-flight requests are answered first (within ``grace_s``). Every model is
    loaded (and warmed up) before the server listens; one that cannot be stops the command.

    ``load_options`` are ``ait.load``'s options (``ait.LoadOptions``, or a mapping of its keyword
    arguments: ``expected_sha256``, ``trusted_keys``, ``check``...), the same for every model. gRPC is
    served on ``grpc_port`` when given (kserve's gRPC server listens on every interface). A REST body
    larger than ``max_body_bytes`` is refused (413) as soon as that many bytes came, one that stalls
    for ``read_timeout_s`` is dropped (408): :mod:`.limits`.
    """
    if not models:
        raise ValueError("serve_models needs at least one (factory, artifact, name)")
    sys.path.insert(0, os.getcwd())  # --factory mymodels:build imports from where the command runs
    served: list[TunedModel] = []
    for factory, artifact, name in models:
        path = Path(artifact)
        if not path.is_file():
            raise FileNotFoundError(f"{artifact}: no such artifact")
        resolve_factory(factory)  # fails here, with the import error, before anything loads
        model_name = name or path.stem
        if model_name in {m.name for m in served}:
            raise ValueError(f"two models would be served as {model_name!r}: rename one artifact, or serve them apart")
        served.append(
            TunedModel(
                model_name,
                factory,
                path,
                load_options=load_options,
                threads=threads,
                eager=eager,
                max_rows=max_rows,
                pad=pad,
            )
        )
    with _signals_deferred() as stopped:
        for model in served:
            factory = model.factory
            print(
                f"loading {model.artifact} into {factory if isinstance(factory, str) else 'the factory'}'s model",
                flush=True,
            )
            try:
                model.load()
            except AituneError:  # the artifact's or the load check's: its message says what to do
                raise
            except Exception as exc:  # the factory's model, or the warm-up call, failed
                raise ServeStartError(f"{model.artifact} could not be served: {_first_line(exc)}") from exc
            if stopped:
                break
    if stopped:
        print("stopped before serving (a signal came while the model loaded)", flush=True)
        return
    server = _Server(
        host,
        {"max_body_bytes": max_body_bytes, "read_timeout_s": read_timeout_s},
        http_port=port,
        grpc_port=grpc_port or 0,
        enable_grpc=grpc_port is not None,
        workers=1,
        enable_latency_logging=False,
        grace_period=grace_s,
    )
    grpc = f", gRPC on port {grpc_port}" if grpc_port is not None else ""
    for model in served:
        print(
            f"serving {model.artifact} as model {model.name!r}{' (eager)' if eager else ''} at "
            f"http://{host}:{port}/v2/models/{model.name}{grpc}",
            flush=True,
        )
    print("Ctrl-C or SIGTERM drains and stops", flush=True)
    server.start(list(served))
    print("stopped", flush=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else '(no message)'}"
