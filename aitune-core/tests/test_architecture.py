"""The architecture holds: every core module has a layer, no import cycle, and the API survives any import order.

``nox -s lint`` checks the contracts of ``.importlinter``; these tests make sure a new module gets a
place in them (a module left out of the layers could import anything and bring a cycle back
unseen), that grimp finds no strongly connected component even counting what a package's
``__init__`` runs, and that importing any public module first leaves ``ait.load`` and ``ait.save``
the functions the docs describe.
"""

from __future__ import annotations

import configparser
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import aitune

CONTRACTS = Path(__file__).resolve().parents[2] / ".importlinter"
PUBLIC = [
    "aitune",
    "aitune.torch",
    "aitune.torch.backend",
    "aitune.torch.config",
    "aitune.torch.jit",
    "aitune.torch.jit.config",
    "aitune.torch.jit.tune",
    "aitune.torch.task.profiling",
    "aitune.torch.task.profiling.profiling_stop_strategy",
    "aitune.artifact",
    "aitune.artifact.reader",
    "aitune.artifact.writer",
    "aitune.backend",
    "aitune.executor",
    "aitune.hookspecs",
    "aitune.registry",
    "aitune.session",
    "aitune.testing",
    "aitune.engine.tuner",
    "aitune.builds.isolation",
]


def _layered() -> set[str]:
    parser = configparser.ConfigParser()
    parser.read(CONTRACTS, encoding="utf-8")
    layers = parser["importlinter:contract:core-layers"]["layers"]
    return {name.strip() for line in layers.splitlines() for name in re.split(r"[|:]", line) if name.strip()}


def _core_modules() -> set[str]:
    """``aitune.<x>``: the units the layers are drawn between."""
    return {f"aitune.{m.name}" for m in pkgutil.iter_modules(aitune.__path__)}


def test_every_core_module_has_a_layer():
    missing = _core_modules() - _layered()
    assert not missing, f"add these to the core-layers contract in {CONTRACTS.name}: {sorted(missing)}"


def test_the_layers_name_no_module_that_is_gone():
    gone = _layered() - _core_modules()
    assert not gone, f"remove these from the core-layers contract in {CONTRACTS.name}: {sorted(gone)}"


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of the import graph; importing ``a.b.c`` runs ``a`` and ``a.b`` too."""
    modules = set(graph.modules)

    def successors(module: str) -> set[str]:
        out = set(graph.find_modules_directly_imported_by(module))
        for imported in list(out):
            parts = imported.split(".")
            for i in range(1, len(parts)):
                package = ".".join(parts[:i])
                if package in modules and not module.startswith(package + ".") and package != module:
                    out.add(package)
        return out

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in successors(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 5000))
    try:
        for module in sorted(modules):
            if module not in index:
                visit(module)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_no_import_cycle_counting_package_inits():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("aitune", exclude_type_checking_imports=False)
    cycles = _cycles(graph)
    assert not cycles, f"import cycles (each a strongly connected component): {cycles}"


def test_a_cycle_through_a_package_init_is_found():
    """The check itself: a module importing a sibling of a package whose __init__ imports it back."""

    edges = {"p": {"q"}, "q": {"p.impl"}, "p.impl": set(), "p.api": set()}
    graph = SimpleNamespace(modules=set(edges), find_modules_directly_imported_by=edges.__getitem__)
    assert _cycles(graph) == [["p", "q"]]


@pytest.mark.parametrize("first", PUBLIC)
def test_any_public_module_imported_first_leaves_the_api_whole(first):
    code = (
        f"import {first}\n"
        "import inspect\n"
        "import aitune.torch as ait\n"
        "assert inspect.isfunction(ait.load) and inspect.isfunction(ait.save), (ait.load, ait.save)\n"
        "assert inspect.isfunction(ait.tune) and inspect.isfunction(ait.inspect), (ait.tune, ait.inspect)\n"
        "import aitune.torch.config, aitune.engine.settings\n"
        "assert ait.config is aitune.torch.config is aitune.engine.settings.settings\n"
        "import aitune.torch.jit.config, aitune.engine.jit.settings\n"
        "assert aitune.torch.jit.config is aitune.engine.jit.settings.settings\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


ENTRY_POINTS = {
    "aitune/cli.py": "the aitune command",
    "aitune/demo.py": "aitune demo",
    "aitune/engine/tuner.py": "ait.tune",
    "aitune/engine/jit/hooks.py": "aitune.torch.jit.enable",
    "aitune/artifact/reader.py": "ait.load and aitune verify",
    "aitune/artifact/writer.py": "ait.save",
    "aitune/torch/backend.py": "from aitune.torch.backend import <a plugin's class> (an import names no manager)",
    "aitune/testing/conformance.py": "the conformance suite, a test's entry point",
    "aitune/testing/configs.py": "config JSON helpers for tests and scripts",
}
"""Where a run starts, so the only places that may look the plugin manager up."""


def test_the_manager_is_looked_up_only_at_entry_points():
    """Everything below an entry point is handed the run's session (see aitune.session)."""
    source = Path(aitune.__file__).parent
    callers = {
        str(path.relative_to(source.parent))
        for path in source.rglob("*.py")
        if "get_manager()" in path.read_text(encoding="utf-8") and path.name != "plugins.py"
    }
    stray = callers - set(ENTRY_POINTS)
    assert not stray, f"get_manager() below an entry point (hand the session down instead): {sorted(stray)}"
