"""``aitune.payload``: the one store that writes a backend's payload with its digests and reads it back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import aitune.torch as ait
from aitune import payload
from aitune.backend import LoadContext
from aitune.errors import SerializationError
from aitune.plugins import get_manager
from aitune.testing.backends import ToyBackend, ToyConfig


def tuned() -> ait.Module:
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    strategy = ait.FirstWinsStrategy([ToyBackend(ToyConfig(speed=0.5))], performance_validation=False)
    model = ait.Module(inner, "m", strategy=strategy)
    ait.tune(model, [torch.randn(2, 8)])
    assert model.state == "tuned"
    return model


def test_a_written_payload_reads_back_as_the_backend_that_wrote_it(toy_backends, tmp_path: Path) -> None:
    model = tuned()
    [(graph, backend)] = model.tuned_graphs
    session = get_manager().session()
    record = payload.write(backend, tmp_path, session)
    assert record.backend == "toy" and record.metadata == {"speed": 0.5}
    assert set(record.files or {}) == {"toy.txt"} and record.distribution == "aitune-core"
    assert payload.from_json(payload.to_json(record)) == record
    context = LoadContext(graph, torch.device("cpu"), record.metadata, tmp_path, "m")
    loaded = payload.read(record, tmp_path, model.module, context, session, False)
    assert isinstance(loaded, ToyBackend) and loaded.config.speed == 0.5
    x = torch.randn(2, 8)
    torch.testing.assert_close(loaded.infer(x), model.module(x))


def test_a_payload_changed_after_it_was_written_is_refused(toy_backends, tmp_path: Path) -> None:
    model = tuned()
    [(graph, backend)] = model.tuned_graphs
    session = get_manager().session()
    record = payload.write(backend, tmp_path, session)
    (tmp_path / "toy.txt").write_text("0.5 ")
    context = LoadContext(graph, torch.device("cpu"), record.metadata, tmp_path, "m")
    with pytest.raises(SerializationError, match="toy.txt does not match its recorded SHA-256"):
        payload.read(record, tmp_path, model.module, context, session, False)


def test_a_record_read_from_a_file_is_checked_field_by_field() -> None:
    with pytest.raises(Exception, match="files"):
        payload.from_json(
            {"backend": "toy", "config": {}, "metadata": {}, "files": ["toy.txt"], "distribution": "d", "version": "1"}
        )
