"""The half of an isolated AOT build that runs in the user's process, on CPU: ``export`` writes the
exported program a worker compiles; ``build_exported`` without the runtime refuses, saying what to install."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from aitune.backend import BuildContext
from aitune.errors import BackendUnavailableError, BuildError
from aitune.testing import assert_matches_eager
from aitune_backend_torchtrt.backend import EXPORTED_FILE, TorchTensorRTAotBackend
from aitune_backend_torchtrt.config import TorchTensorRTAotBackendConfig
from aitune_backend_torchtrt.versions import runtime_problem

CUDA = torch.device("cuda")  # the device the engines are for; nothing here touches it


def _context(graph, samples, tmp_path: Path, device: torch.device = CUDA) -> BuildContext:
    return BuildContext(graph, samples, device, tmp_path, tmp_path / "cache")


@pytest.fixture(scope="module")
def exported(encoder, make_samples, make_graph, tmp_path_factory: pytest.TempPathFactory):
    samples = make_samples()
    graph = make_graph(encoder, samples)
    folder = tmp_path_factory.mktemp("exported")
    notes = TorchTensorRTAotBackend().export(encoder, _context(graph, samples, folder.parent), folder)
    return notes, folder, graph


def test_export_writes_one_program_with_json_notes(exported) -> None:
    notes, folder, graph = exported
    assert json.loads(json.dumps(notes)) == notes
    assert notes["program"] == EXPORTED_FILE
    assert [p.name for p in folder.iterdir()] == [EXPORTED_FILE]
    assert notes["dynamic_dims"] == {n: [r.min, r.opt, r.max] for n, r in graph.dims.items() if r.min < r.max}
    assert set(notes["dynamic_dims"]) == {"batch", "d0"}
    assert "torch_tensorrt" not in sys.modules and "tensorrt" not in sys.modules


def test_the_saved_program_keeps_every_dynamic_dim_and_the_keyword_input(exported, encoder, make_samples) -> None:
    """What the worker reads back runs shapes no sample had, with the keyword-only input."""
    _, folder, _ = exported
    program = torch.export.load(folder / EXPORTED_FILE).module()  # aitune's own file, written just now
    for sample in make_samples(((3, 6), (2, 5), (3, 7))):
        with torch.no_grad():
            assert_matches_eager(program(*sample.args, **sample.kwargs), encoder(*sample.args, **sample.kwargs))


def test_export_refuses_what_cannot_build(encoder, make_samples, make_graph, tmp_path: Path) -> None:
    samples = make_samples()
    graph = make_graph(encoder, samples)
    with pytest.raises(BackendUnavailableError, match="CUDA devices only"):
        TorchTensorRTAotBackend().export(encoder, _context(graph, samples, tmp_path, torch.device("cpu")), tmp_path)
    with pytest.raises(BuildError, match="one recorded sample"):
        TorchTensorRTAotBackend().export(encoder, _context(graph, [], tmp_path), tmp_path)
    zero_to_one = make_samples(((0, 5), (1, 5)))
    with pytest.raises(BuildError, match="specialises sizes 0"):
        TorchTensorRTAotBackend().export(
            encoder, _context(make_graph(encoder, zero_to_one), zero_to_one, tmp_path), tmp_path
        )
    assert not list(tmp_path.glob("*.pt2"))


@pytest.mark.skipif(runtime_problem() is None, reason="checks the refusal where Torch-TensorRT is missing")
def test_build_exported_without_the_runtime_says_what_to_install(exported, tmp_path: Path) -> None:
    notes, folder, graph = exported
    config = TorchTensorRTAotBackendConfig()
    with pytest.raises(BackendUnavailableError, match=r"aitune-backend-torchtrt\[torch2\d+\]"):
        TorchTensorRTAotBackend.build_exported(config, folder, notes, _context(graph, [], tmp_path), tmp_path)
    assert "torch_tensorrt" not in sys.modules
    assert not list(tmp_path.glob("*.pt2"))
