"""Shared fixtures: one Inductor cache for the whole session (CPU compiles are the slow part)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from aitune.backend import Backend, BuildContext
from aitune.graph import GraphSpec, Sample, infer_graph


@pytest.fixture(scope="session", autouse=True)
def shared_inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every build in the session, the conformance tests and fresh processes included, shares one cache."""
    folder = tmp_path_factory.mktemp("inductor-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Backend, GraphSpec]]:
    """Build ``backend`` for ``module`` from ``samples`` on CPU, as the engine would."""

    def run(backend: Backend, module: torch.nn.Module, samples: list[Sample]) -> tuple[Backend, GraphSpec]:
        with torch.no_grad():
            outputs = [module(*s.args, **s.kwargs) for s in samples]
        graph = infer_graph(samples, arg_names=["x"], outputs=outputs)
        workdir = tmp_path_factory.mktemp("work")
        context = BuildContext(graph, samples, torch.device("cpu"), workdir, tmp_path_factory.getbasetemp() / "aitune")
        with torch.no_grad():
            backend.build(module, context)
        return backend, graph

    return run
