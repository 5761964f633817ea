"""An isolated AOTInductor build compiles what the user's process exported, not a lesser copy of it.

``torch.export.save``/``load`` loses the ranges the dynamic sizes were traced under and the custom
operators a model's package registers (``roundtrip.py``); the worker restores both.
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest
import torch

from aitune.backend import BuildContext, LoadContext
from aitune.graph import Sample, infer_graph
from aitune.testing import assert_matches_eager
from aitune_backend_inductor.aot import TorchInductorAotBackend


def _context(module: torch.nn.Module, samples: list[Sample], tmp_path: Path) -> BuildContext:
    with torch.no_grad():
        graph = infer_graph(samples, arg_names=["x"], outputs=[module(*s.args) for s in samples])
    return BuildContext(graph, samples, torch.device("cpu"), tmp_path, tmp_path / "cache")


def _load(metadata: dict, payload: Path, module: torch.nn.Module, context: BuildContext) -> TorchInductorAotBackend:
    loaded = TorchInductorAotBackend()
    loaded.load(module, payload, LoadContext(context.graph, torch.device("cpu"), metadata, context.cache_dir))
    return loaded


@pytest.mark.slow
def test_a_worker_build_keeps_the_batch_axis_of_a_range_up_to_two(tmp_path: Path) -> None:
    """A Conv2d tuned at batch 1 and 2: export traces batch in 2..2 and states 1..2; the loaded
    program said 1..2 to Inductor, whose package then answered batch 2 at batch 1."""
    torch.manual_seed(0)
    module = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1).eval()
    samples = [Sample((torch.randn(b, 3, 16, 16),), {}) for b in (1, 2)]
    context = _context(module, samples, tmp_path)
    backend = TorchInductorAotBackend()
    (tmp_path / "exported").mkdir()
    with torch.no_grad():
        notes = backend.export(module, context, tmp_path / "exported")
    assert notes is not None

    # build_exported reads the saved file, as the worker does (here in-process: the load is the round trip)
    payload = tmp_path / "payload"
    payload.mkdir()
    metadata = TorchInductorAotBackend.build_exported(backend.config, tmp_path / "exported", notes, context, payload)

    loaded = _load(metadata, payload, module, context)
    for batch in (1, 2):
        x = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            assert_matches_eager(loaded.infer(x), module(x))
    assert list(notes["compiler_ranges"].values()) == [[2, 2]], "the range batch was traced under, not the user's"


OPS_MODULE = '''
"""Registers a custom operator at import, as transformers' integrations do."""
import torch

@torch.library.custom_op("{ns}::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2

@scaled_tanh.register_fake
def _(x):
    return torch.empty_like(x)
'''


class CallsCustomOp(torch.nn.Module):
    def __init__(self, op: object) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.fc(x))  # type: ignore[operator]


@pytest.mark.slow
def test_the_worker_imports_the_module_that_registers_a_custom_operator(tmp_path: Path, monkeypatch) -> None:
    """A real worker process: without importing the operator's module it could not read the program
    (Mixtral's experts call ``transformers::grouped_mm_fallback``)."""
    import importlib
    import sys

    from aitune.executor import run_worker

    name = f"aitune_ops_{tmp_path.name.replace('-', '_')}"
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / f"{name}.py").write_text(textwrap.dedent(OPS_MODULE.format(ns=name)))
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'lib'}:{__import__('os').environ.get('PYTHONPATH', '')}")
    ops = importlib.import_module(name)
    assert name in sys.modules

    torch.manual_seed(0)
    module = CallsCustomOp(ops.scaled_tanh).eval()
    context = _context(module, [Sample((torch.randn(b, 8),), {}) for b in (1, 4)], tmp_path)
    backend = TorchInductorAotBackend()
    folder = tmp_path / "isolated"
    (folder / "exported").mkdir(parents=True)
    with torch.no_grad():
        notes = backend.export(module, context, folder / "exported")
    assert notes is not None

    metadata = run_worker(backend, notes, context, folder)  # a fresh process: only the notes say what to import

    loaded = _load(metadata, folder / "payload", module, context)
    for batch in (1, 3, 4):
        x = torch.randn(batch, 8)
        with torch.no_grad():
            assert_matches_eager(loaded.infer(x), module(x))
    assert notes["imports"] == [name]


def test_an_operator_registered_in_a_script_builds_in_process(tmp_path: Path, caplog) -> None:
    """An operator defined in the user's ``__main__`` cannot be registered by a worker: the export
    says so and hands the build to this process before any worker starts."""
    namespace = {"__name__": "__main__", "torch": torch}
    source = OPS_MODULE.format(ns=f"aitune_main_{tmp_path.name.replace('-', '_')}")
    exec(compile(source, "<stdin>", "exec"), namespace)  # what `python script.py` defining an op does
    module = CallsCustomOp(namespace["scaled_tanh"]).eval()
    context = _context(module, [Sample((torch.randn(b, 8),), {}) for b in (1, 4)], tmp_path)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="aitune"):
        notes = TorchInductorAotBackend().export(module, context, tmp_path)
    assert notes is None
    assert "scaled_tanh" in caplog.text and "builds in this process" in caplog.text
    assert not list(tmp_path.glob("*.pt2")), "no program is written for a worker that will not run"


@pytest.mark.parametrize("name", ["os; import sys", "../evil", ""])
def test_the_worker_imports_only_module_names(name: str) -> None:
    from aitune.errors import BuildError
    from aitune_backend_inductor.roundtrip import import_modules

    with pytest.raises(BuildError, match="not a module name"):
        import_modules([name])
