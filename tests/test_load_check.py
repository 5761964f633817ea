"""``ait.load(check=...)``: a payload from an artifact nobody pinned or signed is run once against
eager with the artifact's own weights, so a swapped ONNX graph or reordered outputs are refused."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import aitune.torch as ait
from aitune.errors import ArtifactError
from aitune.plugins import get_manager


def _onnxruntime() -> Any:
    registry = get_manager().registry
    if "onnxruntime" not in registry or registry.status("onnxruntime").reason("cpu"):
        pytest.skip("onnxruntime cannot run here")
    return registry.backend_class("onnxruntime")()


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"first": self.a(x), "second": self.b(x)}


def saved(module: torch.nn.Module, path: Path) -> Path:
    model = ait.Module(module, "m", strategy=ait.OneBackendStrategy(_onnxruntime(), performance_validation=False))
    ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)], end_to_end=False)
    return ait.save(model, path)


def read(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist() if n != "SHA256SUMS"}


def write(members: dict[str, bytes], path: Path) -> Path:
    sums = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in sorted(members.items()))
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr("SHA256SUMS", sums)
    return path


def test_a_swapped_onnx_graph_is_refused(tmp_path: Path) -> None:
    mine = read(saved(mlp(0), tmp_path / "mine.ait"))
    other = read(saved(mlp(1), tmp_path / "other.ait"))
    graphs = [n for n in mine if n.endswith(".onnx")]
    assert graphs and all(n in other for n in graphs)
    swapped = write({**mine, **{n: other[n] for n in graphs}}, tmp_path / "swapped.ait")
    model = mlp(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ArtifactError, match="does not answer as eager does"):
        ait.load(model, swapped, weights="artifact")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    loaded = ait.load(mlp(5), tmp_path / "mine.ait", weights="artifact")  # the faithful one passes
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), mlp(0)(x), rtol=1e-4, atol=1e-5)


def test_reordered_outputs_are_refused(tmp_path: Path) -> None:
    members = read(saved(TwoHeads().eval(), tmp_path / "heads.ait"))
    manifest = json.loads(members["manifest.json"])
    structure = manifest["modules"][0]["graphs"][0]["graph"]["output_structure"]
    assert structure["keys"] == ["first", "second"]
    structure["keys"] = ["second", "first"]  # each name now gets the other head's tensor
    members["manifest.json"] = json.dumps(manifest).encode()
    bad = write(members, tmp_path / "reordered.ait")
    with pytest.raises(ArtifactError, match="does not answer as eager does"):
        ait.load(TwoHeads().eval(), bad)
    with pytest.warns(RuntimeWarning, match="does not answer as eager does"):
        assert ait.load(TwoHeads().eval(), bad, fallback="eager").state == "passthrough"
