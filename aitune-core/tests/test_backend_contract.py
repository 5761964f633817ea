"""Helpers of the Backend contract that backends share."""

from __future__ import annotations

import pytest

from aitune.backend import exported_file
from aitune.errors import BuildError


def test_exported_file_accepts_only_plain_names_that_exist(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"x")
    assert exported_file(tmp_path, {"onnx": "model.onnx"}, "onnx") == tmp_path / "model.onnx"
    assert exported_file(tmp_path, {}, "onnx", "model.onnx") == tmp_path / "model.onnx"
    for hostile in ("../model.onnx", "/etc/passwd", "..", "", 3):
        with pytest.raises(BuildError, match="not a plain file name"):
            exported_file(tmp_path, {"onnx": hostile}, "onnx")
    with pytest.raises(BuildError, match="missing .* the export did not finish"):
        exported_file(tmp_path, {"onnx": "other.onnx"}, "onnx")
