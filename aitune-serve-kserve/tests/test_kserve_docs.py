"""The kserve engine's docs run as written: every command and request of the member's README and of
docs/serving.md's kserve section, against a real ``aitune serve``.

The blocks are read from the files, never copied here (:mod:`aitune_testkit.docs`). What a reader's
machine has and this one lacks is mapped, and only that: ``.venv/bin/`` is this interpreter's folder,
the ports are free ones, ``model.ait`` and ``mymodels.py`` are the test model's artifact and factory.
"""

from __future__ import annotations

import json

import pytest
from aitune_testkit import docs
from kserve_harness import HERE

httpclient = pytest.importorskip("tritonclient.http")

pytestmark = pytest.mark.slow
ROOT = HERE.parents[1]
README = ROOT / "aitune-serve-kserve" / "README.md"
SERVING = ROOT / "docs" / "serving.md"


@pytest.mark.parametrize("source", ["README", "docs/serving.md"])
def test_every_command_and_request_runs_as_written(source, artifact, tmp_path):
    text = (
        README.read_text() if source == "README" else docs.section(SERVING, "### On one machine: KServe's ModelServer")
    )
    [bash] = docs.blocks(text, "bash")
    install, serve, *requests = docs.commands(bash)
    assert install.startswith(".venv/bin/pip install -c constraints.txt aitune-serve-kserve"), install
    assert serve.startswith(".venv/bin/aitune serve model.ait --factory mymodels:build_model"), serve
    reader = docs.Reader(
        tmp_path,
        files={"model.ait": artifact, "mymodels.py": "from kserve_testmodel import build as build_model\n"},
        ports=(8000, 8001),
        pythonpath=[HERE],
    )
    server = reader.start(serve)
    try:
        reader.wait_ready(server, reader.mapped("127.0.0.1:8000"), ["model"], within_s=120)
        for request in requests:  # the README's curl lines: metadata, then an inference
            answer = json.loads(reader.shell(request))
            assert "error" not in answer, (request, answer)
            if request.endswith("/v2/models/model"):
                assert answer["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 8, 16]}]
            else:
                assert [o["name"] for o in answer["outputs"]] == ["logits", "pooled"]
                assert answer["parameters"]["aitune_backend"] == "model=onnxruntime"
        for block in docs.blocks(text, "python"):
            scope = reader.python(block)
            logits = scope["result"].as_numpy("logits")
            assert logits.shape == (1, 4)
            assert scope["result"].get_response()["parameters"]["aitune_backend"] == "model=onnxruntime"
    finally:
        status = docs.stop(server, timeout_s=60)
    assert status == 0, reader.output()
