"""Tensors in and out of the protocol's numpy arrays (:mod:`kserve_arrays`, in a process of its own:
kserve and tritonclient.grpc, which other tests import, cannot share one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
CHECKS = (
    "test_a_request_is_checked_on_its_arrays_and_a_bfloat16_input_made_from_fp32",
    "test_every_protocol_datatype_has_its_numpy_dtype",
    "test_an_answer_on_the_host_is_handed_over_without_a_copy_and_any_other_made_into_one",
    "test_a_request_to_a_tuned_onnx_runtime_graph_is_answered_from_its_arrays",
)


def test_requests_and_answers_cross_between_numpy_and_torch_as_the_protocol_needs(artifact):
    done = subprocess.run(
        [sys.executable, str(HERE / "kserve_arrays.py"), str(artifact)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=HERE,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split()[-1] for line in done.stdout.splitlines() if line.startswith("passed")] == list(CHECKS)
