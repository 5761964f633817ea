"""A real ``aitune serve`` process on 127.0.0.1 and free ports, with bounded waits and always torn down."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``aitune serve`` in a process of its own, as a user starts it."""

    def __init__(
        self, artifact: Path, log: Path, *extra: str, factory: str = "kserve_testmodel:build", threads: str | None = "1"
    ) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.log = log
        command = [sys.executable, "-m", "aitune", "serve", str(artifact), "--factory", factory]
        command += ["--port", str(self.port), "--grpc-port", str(self.grpc_port)]
        command += ["--threads", threads, *extra] if threads else list(extra)  # None: the artifact's threads
        self.process = subprocess.Popen(
            command,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            cwd=HERE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))},
        )
        self.url = f"127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text()[-4000:]

    def wait_ready(self, model: str, timeout_s: float = 120) -> None:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(self.url)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                assert self.process.poll() is None, self.output()
                with contextlib.suppress(Exception):  # not listening yet
                    if client.is_model_ready(model):
                        return
                assert time.monotonic() < deadline, f"not ready within {timeout_s} s:\n{self.output()}"
                time.sleep(0.5)
        finally:
            client.close()

    def stop(self, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


@contextlib.contextmanager
def running(
    artifact: Path, log: Path, *extra: str, factory: str = "kserve_testmodel:build", threads: str | None = "1"
) -> Iterator[Server]:
    server = Server(artifact, log, *extra, factory=factory, threads=threads)
    try:
        yield server
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
