"""The layers contract in ``.importlinter`` names every module of aitune-core, so none escapes it.

``nox -s lint`` checks the contract; this test makes sure a new module gets a place in it (a
module left out of the layers could import anything and bring a cycle back unseen).
"""

from __future__ import annotations

import configparser
import pkgutil
from pathlib import Path

import aitune
import aitune.torch

CONTRACTS = Path(__file__).resolve().parents[2] / ".importlinter"


def _layered() -> set[str]:
    parser = configparser.ConfigParser()
    parser.read(CONTRACTS, encoding="utf-8")
    layers = parser["importlinter:contract:core-layers"]["layers"]
    return {name.strip() for line in layers.splitlines() for name in line.split("|") if name.strip()}


def _core_modules() -> set[str]:
    """``aitune.<x>`` and ``aitune.torch.<x>``: the units the layers are drawn between."""
    names = {f"aitune.{m.name}" for m in pkgutil.iter_modules(aitune.__path__) if m.name != "torch"}
    names |= {f"aitune.torch.{m.name}" for m in pkgutil.iter_modules(aitune.torch.__path__)}
    return names


def test_every_core_module_has_a_layer():
    missing = _core_modules() - _layered()
    assert not missing, f"add these to the core-layers contract in {CONTRACTS.name}: {sorted(missing)}"


def test_the_layers_name_no_module_that_is_gone():
    gone = _layered() - _core_modules()
    assert not gone, f"remove these from the core-layers contract in {CONTRACTS.name}: {sorted(gone)}"
