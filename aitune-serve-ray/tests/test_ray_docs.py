"""The Ray Serve engine's docs run as written: every command, request and config file of the member's
README and of docs/serving.md's Ray Serve section, against a real ``aitune serve --engine ray`` and a
real ``serve run``, checked with Ray's own ``serve status``.

The blocks are read from the files, never copied here (:mod:`aitune_testkit.docs`). What a reader's
machine has and this one lacks is mapped, and only that: ``.venv/bin/`` is this interpreter's folder,
the ports are free ones (8265, for ``serve run``, the shared Ray's dashboard), ``model.ait`` and
``mymodels.py`` are the test model's artifact and factory, an ``artifact: /models/`` is in the reader's folder, the
``expected_sha256: ...`` left to the reader is the artifact's digest, and the running Ray that
``serve run`` joins is this folder's shared one, its address where ``ray start --head`` leaves it
(``ray_current_cluster`` in Ray's temp folder, ``RAY_TMPDIR``'s here). The commands run without the
``RAY_AUTH_MODE`` and ``RAY_ADDRESS`` that ``ray.init`` may have put in this process's environment,
as in a reader's shell.
The same command in both files runs once, for both.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
import torch
import yaml
from aitune_testkit import docs, serving

from aitune.testing import assert_matches_eager

httpclient = pytest.importorskip("tritonclient.http")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
README = ROOT / "aitune-serve-ray" / "README.md"
SERVING = ROOT / "docs" / "serving.md"
MYMODELS = "from aitune_testkit.serving import build_two_heads as build_model\n"


def _sources() -> dict[str, str]:
    return {"README": README.read_text(), "docs/serving.md": docs.section(SERVING, "### On a cluster: Ray Serve")}


def _block(text: str, language: str, holding: str) -> str:
    [block] = [b for b in docs.blocks(text, language) if holding in b]
    return block


def _wait_for_line(reader: docs.Reader, process, start: str, within_s: float) -> None:
    """Until the server's output has a line starting with ``start`` (``aitune serve`` prints ``serving
    ...`` once the application is up)."""
    deadline = time.monotonic() + within_s
    while not any(line.startswith(start) for line in reader.output(tail=100_000).splitlines()):
        assert process.poll() is None, reader.output()
        assert time.monotonic() < deadline, f"no {start!r} line within {within_s:.0f} s:\n{reader.output()}"
        time.sleep(0.5)


def _statuses(reader: docs.Reader, line: str, apps: list[str], within_s: float = 60) -> dict[str, tuple]:
    """Each application's status and its deployments' (as Serve's controller sees their replicas) in
    what the documented ``serve status`` prints, once none of ``apps`` is still deploying (its status
    lags the replicas' readiness by a controller loop)."""
    deadline = time.monotonic() + within_s
    while True:
        said = yaml.safe_load(reader.shell(line))
        statuses = {
            name: (app["status"], {d: info["status"] for d, info in (app.get("deployments") or {}).items()})
            for name, app in (said.get("applications") or {}).items()
        }
        settled = all(statuses.get(app, (None,))[0] not in (None, "NOT_STARTED", "DEPLOYING") for app in apps)
        if settled or time.monotonic() > deadline:
            return statuses
        time.sleep(1)


RUNNING = ("RUNNING", {"TunedModel": "HEALTHY"})
"""An application serving, its one deployment's replicas healthy."""


def _checked_answer(request: str, answer: dict) -> None:
    """A documented curl request's JSON answer: the metadata of the test model, or its inference."""
    assert "error" not in answer, (request, answer)
    if request.endswith(("/v2/models/model", "/v2/models/retuned")):
        assert answer["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 8, 16]}], answer
        assert [o["name"] for o in answer["outputs"]] == ["logits", "pooled"], answer
    else:
        assert request.split()[2].endswith("/v2/models/model/infer"), f"a request this test does not check: {request}"
        assert [o["name"] for o in answer["outputs"]] == ["logits", "pooled"], answer
        assert answer["parameters"]["aitune_backend"] == "encoder=onnxruntime", answer


def test_aitune_serve_commands_and_requests_run_as_written(artifact, tmp_path):
    """``pip install``'s line as the Quick start's venv has it, then ``aitune serve --engine ray`` as
    written (its own local Ray, two replicas, the dashboard), each curl request, ``serve status``
    reading the application RUNNING, the Python client's request; SIGTERM then exits 0."""
    flows: dict[str, list[str]] = {}  # the serve command: the lines after it, of every file that gives it
    pythons: dict[str, list[str]] = {}
    for source, text in _sources().items():
        install, serve, *rest = docs.commands(_block(text, "bash", "aitune serve"))
        assert install.startswith(".venv/bin/pip install -c constraints.txt aitune-serve-ray"), (source, install)
        assert serve.startswith(".venv/bin/aitune serve model.ait --factory mymodels:build_model --engine ray"), serve
        flows.setdefault(serve, []).extend(rest)
        pythons.setdefault(serve, []).extend(docs.blocks(text, "python"))
    for n, (serve, rest) in enumerate(flows.items()):
        folder = tmp_path / f"reader{n}"
        folder.mkdir()
        ray_temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's sockets need a short path; nox's TMPDIR is long
        reader = docs.Reader(
            folder,
            files={"model.ait": artifact, "mymodels.py": MYMODELS},
            ports=(8000, 8265),
            env={"RAY_AUTH_MODE": None, "RAY_ADDRESS": None, "RAY_TMPDIR": ray_temp},
        )
        server = reader.start(serve)
        try:
            reader.wait_ready(server, reader.mapped("127.0.0.1:8000"), ["model"], within_s=240)
            _wait_for_line(reader, server, "serving ", within_s=120)  # the documented point to ask serve status
            for line in rest:
                if line.startswith("curl "):
                    _checked_answer(line, json.loads(reader.shell(line)))
                else:
                    assert "serve status" in line, f"a documented command this test does not check: {line}"
                    assert _statuses(reader, line, ["aitune"]) == {"aitune": RUNNING}
            for block in pythons[serve]:
                result = reader.python(block)["result"]
                assert result.as_numpy("logits").shape == (1, 4)
                assert result.get_response()["parameters"]["aitune_backend"] == "encoder=onnxruntime"
        finally:
            status = docs.stop(server, timeout_s=180)  # what docker stop sends
            shutil.rmtree(ray_temp, ignore_errors=True)
        assert status == 0, reader.output()


def test_the_config_file_runs_as_written_with_serve_run(artifact, attach, shared_ray, tmp_path):
    """The documented config file under Ray's own ``serve run`` on a running Ray: both of its
    applications (two artifacts) answer as the tuned model does, the documented curl request is
    answered, ``serve status`` reads both RUNNING and their deployments HEALTHY; Ctrl-C takes them
    down and exits 0."""
    (shared_ray.packages / "mymodels.py").write_text(MYMODELS)  # installed on every node of the Ray
    digest = hashlib.sha256(artifact.read_bytes()).hexdigest()
    flows: dict[tuple[str, str], list[str]] = {}
    for source, text in _sources().items():
        flows.setdefault((_block(text, "yaml", "aitune_serve_ray:app"), _block(text, "bash", "serve run")), []).append(
            source
        )
    x = np.random.default_rng(2).standard_normal((3, 8, 16)).astype(np.float32)
    with torch.no_grad():
        eager = serving.build_two_heads()(torch.from_numpy(x))["logits"]
    for n, ((config, bash), sources) in enumerate(flows.items()):
        folder = tmp_path / f"reader{n}"
        folder.mkdir()
        ray_temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: nox's TMPDIR is long
        (ray_temp / "ray").mkdir()
        (ray_temp / "ray" / "ray_current_cluster").write_text(attach)  # as `ray start --head` leaves it
        reader = docs.Reader(
            folder,
            files={"model.ait": artifact, "retuned.ait": artifact},
            ports={8000: docs.free_port(), 8265: urlparse(shared_ray.dashboard).port},
            replace={
                "artifact: /models/": f"artifact: {folder}/",
                "expected_sha256: ...": f"expected_sha256: {digest}",
            },
            env={"RAY_AUTH_MODE": None, "RAY_ADDRESS": None, "RAY_TMPDIR": str(ray_temp)},
        )
        (folder / "config.yaml").write_text(reader.mapped(config))
        read = yaml.safe_load((folder / "config.yaml").read_text())
        apps = {app["name"]: (app["route_prefix"], Path(app["args"]["artifact"]).stem) for app in read["applications"]}
        assert len(apps) == 2, (sources, apps)  # two artifacts, as issue 52 asks of a config file
        serve_run, *rest = docs.commands(bash)
        assert serve_run.startswith(".venv/bin/serve run config.yaml"), (sources, serve_run)
        server = reader.start(serve_run)
        try:
            url = reader.mapped("127.0.0.1:8000")
            for prefix, model in apps.values():
                reader.wait_ready(server, f"{url}{prefix}", [model], within_s=240)
                client = httpclient.InferenceServerClient(f"{url}{prefix}", network_timeout=60)
                try:
                    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
                    tensor.set_data_from_numpy(x)
                    assert_matches_eager(torch.tensor(client.infer(model, [tensor]).as_numpy("logits")), eager)
                finally:
                    client.close()
            for line in rest:
                if line.startswith("curl "):
                    _checked_answer(line, json.loads(reader.shell(line)))
                else:
                    assert "serve status" in line, f"a documented command this test does not check: {line}"
                    assert _statuses(reader, line, list(apps)) == dict.fromkeys(apps, RUNNING), sources
        finally:
            status = docs.stop(server, signal.SIGINT, timeout_s=180)  # Ctrl-C, as the docs say
            shutil.rmtree(ray_temp, ignore_errors=True)
        assert status == 0, reader.output()
