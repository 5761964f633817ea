"""A Markdown page's commands and requests run as its reader would run them, for the tests that keep
the docs true: the fenced blocks are read from the page (never copied into a test) and run in a
folder of the reader's own, with only what the reader's machine has and the test's lacks mapped (the
virtual environment's folder, the ports, a path or a digest the page leaves to the reader)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path


def blocks(text: str, language: str) -> list[str]:
    """The bodies of the fenced blocks of ``language`` (```` ```bash ````, ```` ```yaml ````...) in
    ``text``, in the page's order."""
    return re.findall(rf"^```{re.escape(language)}\n(.*?)^```", text, flags=re.S | re.M)


def section(page: Path, heading: str) -> str:
    """The section of ``page`` under the heading line ``heading`` (``"### On a cluster: Ray Serve"``):
    up to the next heading of its level or above, outside fenced blocks (a ``# comment`` line in a
    shell block is not a heading), or to the end."""
    text = page.read_text()
    start = text.find(f"{heading}\n")
    if start < 0:
        raise ValueError(f"{page} has no heading line {heading!r}: the test reads that section, rename it in both")
    level = len(heading) - len(heading.lstrip("#"))
    lines = text[start:].splitlines(keepends=True)
    kept, fenced = lines[:1], False
    for line in lines[1:]:
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(rf"#{{1,{level}}} ", line):
            break
        kept.append(line)
    return "".join(kept)


def commands(block: str) -> list[str]:
    """A shell block's commands, one a line: comment lines and a command's trailing ``  # ...`` dropped."""
    return [
        line.split("  #")[0].strip()
        for line in block.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Reader:
    """A reader's shell: their folder holding their files (``files``: a name and the file to copy
    there, or its text), their venv (``.venv/bin/`` is this interpreter's folder), a free port for
    each port the page names (``ports``; a mapping gives the port each one stands for, a running
    server's), and ``replace``'s stand-ins for what else the page leaves
    to them. ``env`` sets (or, with None, removes) variables of the commands' environment, whose
    ``PYTHONPATH`` starts with the folder (``--factory mymodels:...`` imports from there), then
    ``pythonpath`` (where the reader's ``mymodels`` finds the test's model)."""

    def __init__(
        self,
        folder: Path,
        *,
        files: Mapping[str, Path | str] | None = None,
        ports: Iterable[int] | Mapping[int, int] = (),
        replace: Mapping[str, str] | None = None,
        env: Mapping[str, str | None] | None = None,
        pythonpath: Iterable[Path] = (),
    ) -> None:
        self.folder = folder
        for name, content in (files or {}).items():
            if isinstance(content, Path):
                shutil.copyfile(content, folder / name)
            else:
                (folder / name).write_text(content)
        given = ports if isinstance(ports, Mapping) else {port: free_port() for port in ports}
        self.ports = {str(said): str(meant) for said, meant in given.items()}
        self.replace = dict(replace or {})
        path = [str(folder), *map(str, pythonpath), os.environ.get("PYTHONPATH")]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
        for name, value in (env or {}).items():
            if value is None:
                self.env.pop(name, None)
            else:
                self.env[name] = value

    def mapped(self, text: str) -> str:
        """``text`` with the reader's ports, venv and stand-ins replaced by this machine's (the ports
        first: a path put in later may hold the same digits)."""
        if self.ports:
            text = re.sub(rf"\b({'|'.join(self.ports)})\b", lambda m: self.ports[m.group(1)], text)
        text = text.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
        for said, meant in self.replace.items():
            text = text.replace(said, meant)
        return text

    def shell(self, line: str, timeout_s: float = 120) -> str:
        """Runs one documented command in the reader's folder; its stdout. A non-zero exit fails the
        test with the command and its output."""
        done = subprocess.run(
            ["bash", "-c", self.mapped(line)],
            cwd=self.folder,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
        return done.stdout

    def python(self, block: str) -> dict:
        """Runs a documented Python block in this process; the names it left."""
        scope: dict = {}
        exec(compile(self.mapped(block), "<docs>", "exec"), scope)
        return scope

    def start(self, command: str, log: str = "server.log") -> subprocess.Popen:
        """Starts a documented long-running command (its trailing ``&`` dropped) in the background,
        its output to ``log`` in the reader's folder (a pipe nobody reads would stall it)."""
        command = self.mapped(command.strip().removesuffix("&").strip())
        with (self.folder / log).open("w") as out:
            return subprocess.Popen(
                ["bash", "-c", f"exec {command}"], cwd=self.folder, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )

    def output(self, log: str = "server.log", tail: int = 4000) -> str:
        return (self.folder / log).read_text()[-tail:]

    def wait_ready(
        self, process: subprocess.Popen, url: str, models: Iterable[str], within_s: float, log: str = "server.log"
    ) -> None:
        """:func:`wait_ready` with this reader's server output."""
        wait_ready(process, url, models, within_s, lambda: self.output(log))


def wait_ready(
    process: subprocess.Popen, url: str, models: Iterable[str], within_s: float, output: Callable[[], str]
) -> None:
    """Until every model of ``models`` reads ready at ``url`` (``host:port[/prefix]``, Triton's client),
    failing with the server's ``output()`` if it exits or ``within_s`` passes first."""
    import tritonclient.http as httpclient  # type: ignore[import-not-found]  # a test extra, not in typecheck's venv

    client = httpclient.InferenceServerClient(url, network_timeout=10)
    deadline = time.monotonic() + within_s
    try:
        while True:
            assert process.poll() is None, output()
            with contextlib.suppress(Exception):  # not listening yet, or the model not loaded yet
                if all(client.is_model_ready(model) for model in models):
                    return
            assert time.monotonic() < deadline, f"not ready within {within_s:.0f} s:\n{output()}"
            time.sleep(0.5)
    finally:
        client.close()


def stop(process: subprocess.Popen, signum: int = signal.SIGTERM, timeout_s: float = 120) -> int:
    """Sends ``signum`` (SIGTERM: what ``docker stop`` sends; SIGINT: Ctrl-C) and waits for the exit;
    its status. Killed after ``timeout_s`` (the status then says so: -9)."""
    process.send_signal(signum)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()
