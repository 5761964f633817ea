"""The module digest keys cached builds and remembered JIT decisions: it changes with whatever can
change the traced graph (code, weights, and the plain attributes a forward branches on), and is
the same for equal modules in any process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest
import torch

import aitune.torch as ait
from aitune.module_code import module_digest, settings
from aitune.plugins import get_manager


class Flagged(torch.nn.Module):
    """One forward, two answers: which one is set in ``__init__``, where no weight shows it."""

    def __init__(self, negate: bool, config: object | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)
        self.negate = negate
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return -y if self.negate else y


def test_a_flag_or_a_config_value_no_weight_shows_changes_the_digest():
    assert module_digest(Flagged(False)) == module_digest(Flagged(False))
    assert module_digest(Flagged(False)) != module_digest(Flagged(True))
    config = types.SimpleNamespace(attention="sdpa", sizes=[1, 2], nested=types.SimpleNamespace(eps=1e-5))
    module = Flagged(False, config)
    before = module_digest(module)
    config.nested.eps = 1e-6  # a sub-config's value, changed in place after a first digest
    assert module_digest(module) != before
    config.nested.eps = 1e-5
    assert module_digest(module) == before
    wrapped = torch.nn.Sequential(Flagged(False))
    digest = module_digest(wrapped)
    wrapped[0].negate = True  # a submodule's flag
    assert module_digest(wrapped) != digest


def test_every_submodule_is_written_with_its_own_values():
    """Objects are written once per call and found again by id: one freed during the call (a
    submodule's attribute dict, made afresh for each) must not pass its text to the next to get its id."""
    model = torch.nn.Sequential(*[Flagged(i % 3 == 0, types.SimpleNamespace(index=i)) for i in range(40)])
    lines = settings(model).splitlines()[1:]  # the Sequential's own line first
    flagged = [line for line in lines if not line.split(":")[0].endswith(".fc")]
    assert len(flagged) == 40
    for i, line in enumerate(flagged):
        assert line.startswith(f"{i}: ") and f"'negate': {i % 3 == 0}" in line and f"'index': {i}" in line, line


def test_the_digest_is_the_same_in_another_process():
    """Written from values, never from an object's repr (its address changes every process)."""
    code = textwrap.dedent(
        """
        import sys, types, torch
        sys.path.insert(0, sys.argv[1])
        from test_module_digest import Flagged
        from aitune.module_code import module_digest, settings
        print(module_digest(Flagged(True, types.SimpleNamespace(lock=object(), fn=print, name="x"))))
        """
    )
    here = __file__.rsplit("/", 1)[0]
    runs = {
        subprocess.run([sys.executable, "-c", code, here], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    assert len(runs) == 1, runs


def test_a_cached_build_of_another_flag_is_not_reused(tmp_path, monkeypatch):
    """The build cache once served one instance's ONNX graph to another whose flag takes the other branch."""
    registry = get_manager().registry
    if "onnxruntime" not in registry or registry.status("onnxruntime").reason("cpu"):
        pytest.skip("onnxruntime cannot run here")
    monkeypatch.setenv("AITUNE_CACHE_DIR", str(tmp_path / "cache"))
    x = torch.randn(4, 8)
    hits = []
    for negate in (False, True, False):
        backend = registry.backend_class("onnxruntime")(registry.config_class("onnxruntime")())
        model = ait.Module(Flagged(negate), "m", strategy=ait.OneBackendStrategy(backend, performance_validation=False))
        report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
        [candidate] = report.modules[0].graphs[0].candidates
        hits.append(bool(candidate.build_info.get("from_cache")))
        with torch.inference_mode():
            torch.testing.assert_close(model(x), model.module(x))
    assert hits == [False, False, True], "the other flag's build is its own; the same flag's is reused"
