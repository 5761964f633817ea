from __future__ import annotations

import pytest
from aitune_testkit import serving


@pytest.fixture(scope="session")
def artifact(tmp_path_factory):
    """The tiny encoder with two outputs (``logits``, ``pooled``: a client can select one), tuned with
    ONNX Runtime for batches of 2 to 4 rows (about 10 s, once); served as model ``twoheads``.

    Skipped, visibly, where aitune-backend-onnxruntime is not installed (``nox -s
    tests-aitune-serve-ray`` installs this member alone with core and the kserve engine); ``nox -s
    tests`` runs them."""
    pytest.importorskip("aitune_backend_onnxruntime")
    return serving.tune(tmp_path_factory.mktemp("serve") / "twoheads.ait", factory=serving.build_two_heads)
