"""Several artifacts in one ``aitune serve`` (one kserve server, each model under its stem), and the
usage errors that say how to ask for them."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from kserve_harness import HERE, running

from aitune.testing import assert_matches_eager

httpclient = pytest.importorskip("tritonclient.http")

import kserve_testmodel  # noqa: E402

pytestmark = pytest.mark.slow


def test_two_artifacts_are_two_models_of_one_server(artifact, tmp_path):
    first, second = tmp_path / "first.ait", tmp_path / "second.ait"
    shutil.copy(artifact, first)
    shutil.copy(artifact, second)
    with running(first, tmp_path / "serve.log", str(second)) as server:
        server.wait_ready("first")
        client = httpclient.InferenceServerClient(server.url)
        try:
            assert client.is_model_ready("second")
            x = np.random.default_rng(5).standard_normal((2, 8, 16)).astype(np.float32)
            for model in ("first", "second"):
                tensor = httpclient.InferInput("x", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                result = client.infer(model, [tensor])
                assert result.get_response()["parameters"]["aitune_backend"] == "model=onnxruntime"
                with torch.no_grad():
                    expected = kserve_testmodel.build()(torch.from_numpy(x))["logits"]
                assert_matches_eager(torch.from_numpy(result.as_numpy("logits").copy()), expected)
        finally:
            client.close()
        assert server.stop() == 0, server.output()


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--name", "m"], "--name name one artifact"),
        (["--factory", "kserve_testmodel:build"], "3 artifacts and 2 --factory"),
        (["--engine", "ray"], "serve several from a Serve config file"),
    ],
    ids=["name", "factories", "ray"],
)
def test_several_artifacts_with_a_one_artifact_option_is_a_usage_error(artifact, extra, said):
    artifacts = [str(artifact)] * (3 if "--factory" in extra else 2)
    done = subprocess.run(
        [sys.executable, "-m", "aitune", "serve", *artifacts, "--factory", "kserve_testmodel:build", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=HERE,
    )
    assert done.returncode == 2, done.stderr
    assert said in " ".join(done.stderr.replace("│", " ").split())
