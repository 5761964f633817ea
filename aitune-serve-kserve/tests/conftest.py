from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # kserve_testmodel and kserve_harness, as the server process imports them

from kserve_harness import Server, running  # noqa: E402


@pytest.fixture(scope="session")
def artifact(tmp_path_factory):
    """The two-output test model tuned with ONNX Runtime for batches of 2 to 4 rows (a few seconds, once).

    Skipped, visibly, where aitune-backend-onnxruntime is not installed (``nox -s
    tests-aitune-serve-kserve`` installs this member alone with core); ``nox -s tests`` runs them."""
    pytest.importorskip("aitune_backend_onnxruntime")
    import kserve_testmodel

    return kserve_testmodel.tune(tmp_path_factory.mktemp("kserve") / "twoheads.ait")


@pytest.fixture(scope="module")
def server(artifact, tmp_path_factory) -> Iterator[Server]:
    """The tuned artifact served under its stem, REST and gRPC, for a module's tests."""
    with running(artifact, tmp_path_factory.mktemp("log") / "serve.log") as server:
        server.wait_ready("twoheads")
        yield server
