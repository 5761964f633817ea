"""The kserve engine's docs run as written: every command and request of the member's README and of
docs/serving.md's kserve section, against a real ``aitune serve``.

The blocks are read from the files, never copied here. What a reader's machine has and this one
lacks is mapped, and only that: ``.venv/bin/`` is this interpreter's folder, the ports are free
ones, ``model.ait`` and ``mymodels.py`` are the test model's artifact and factory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kserve_harness import HERE, free_port

httpclient = pytest.importorskip("tritonclient.http")

pytestmark = pytest.mark.slow
ROOT = HERE.parents[1]
README = ROOT / "aitune-serve-kserve" / "README.md"
SERVING = ROOT / "docs" / "serving.md"


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def _kserve_section() -> str:
    text = SERVING.read_text()
    start = text.index("### On one machine: KServe's ModelServer")
    return text[start : text.index("\n### ", start + 1)]


class _Reader:
    """A reader's shell: their folder, their venv (this interpreter's), free ports for 8000 and 8001."""

    def __init__(self, folder: Path, artifact: Path) -> None:
        self.folder = folder
        shutil.copy(artifact, folder / "model.ait")
        (folder / "mymodels.py").write_text("from kserve_testmodel import build as build_model\n")
        self.ports = {"8000": str(free_port()), "8001": str(free_port())}
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), str(HERE), os.environ.get("PYTHONPATH")])),
        }

    def mapped(self, text: str) -> str:
        text = text.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
        return re.sub(r"\b(8000|8001)\b", lambda m: self.ports[m.group(1)], text)

    def shell(self, line: str) -> str:
        done = subprocess.run(
            ["bash", "-c", self.mapped(line)],
            cwd=self.folder,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
        return done.stdout

    def python(self, block: str) -> dict:
        scope: dict = {}
        exec(compile(self.mapped(block), "<docs>", "exec"), scope)
        return scope


def _commands(block: str) -> list[str]:
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def _serve(reader: _Reader, command: str) -> subprocess.Popen:
    command = reader.mapped(command.removesuffix("&").strip())
    server = subprocess.Popen(
        ["bash", "-c", f"exec {command}"],
        cwd=reader.folder,
        env=reader.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    client = httpclient.InferenceServerClient(f"127.0.0.1:{reader.ports['8000']}")
    deadline = time.monotonic() + 120
    try:
        while True:
            assert server.poll() is None, server.stdout.read().decode() if server.stdout else ""
            try:
                if client.is_model_ready("model"):
                    return server
            except Exception:  # not listening yet
                pass
            assert time.monotonic() < deadline, "the documented server did not become ready in 120 s"
            time.sleep(0.5)
    finally:
        client.close()


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.parametrize("source", ["README", "docs/serving.md"])
def test_every_command_and_request_runs_as_written(source, artifact, tmp_path):
    text = README.read_text() if source == "README" else _kserve_section()
    [bash] = _blocks(text, "bash")
    commands = _commands(bash)
    install, serve, *requests = commands
    assert install.startswith(".venv/bin/pip install -c constraints.txt aitune-serve-kserve"), install
    assert serve.startswith(".venv/bin/aitune serve model.ait --factory mymodels:build_model"), serve
    reader = _Reader(tmp_path, artifact)
    server = _serve(reader, serve)
    try:
        for request in requests:  # the README's curl lines: metadata, then an inference
            answer = json.loads(reader.shell(request))
            assert "error" not in answer, (request, answer)
            if request.endswith("/v2/models/model"):
                assert answer["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 8, 16]}]
            else:
                assert [o["name"] for o in answer["outputs"]] == ["logits", "pooled"]
                assert answer["parameters"]["aitune_backend"] == "model=onnxruntime"
        for block in _blocks(text, "python"):
            scope = reader.python(block)
            logits = scope["result"].as_numpy("logits")
            assert logits.shape == (1, 4)
            assert scope["result"].get_response()["parameters"]["aitune_backend"] == "model=onnxruntime"
    finally:
        _stop(server)
