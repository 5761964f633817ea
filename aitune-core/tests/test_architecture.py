"""The architecture holds: every core module has a layer, no import cycle, and the API survives any import order.

``nox -s lint`` checks the contracts of ``.importlinter``; these tests make sure a new module gets a
place in them (a module left out of the layers could import anything and bring a cycle back
unseen; one left out of the plugin contracts would be open to plugins), that grimp finds no
strongly connected component even counting what a package's ``__init__`` runs, that importing any
public module first leaves ``ait.load`` and ``ait.save`` the functions the docs describe, and that
every name a plugin imports from ``aitune.plugin`` is exported and documented there.
"""

from __future__ import annotations

import ast
import configparser
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import aitune
import aitune.plugin

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "aitune-core" / "src" / "aitune"
CONTRACTS = ROOT / ".importlinter"
PUBLIC = [
    "aitune",
    "aitune.torch",
    "aitune.torch.backend",
    "aitune.torch.jit",
    "aitune.torch.jit.tune",
    "aitune.torch.serving",
    "aitune.torch.strategies",
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
    "aitune.plugin",
    "aitune.engine.tuner",
    "aitune.builds.isolation",
]


def _contract(name: str) -> configparser.SectionProxy:
    parser = configparser.ConfigParser()
    parser.read(CONTRACTS, encoding="utf-8")
    return parser[f"importlinter:contract:{name}"]


def _listed(contract: str, option: str) -> list[str]:
    return _contract(contract)[option].split()


def _layered() -> set[str]:
    layers = _contract("core-layers")["layers"]
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
        "from aitune.torch import config\n"
        "import aitune.engine.settings\n"
        "assert ait.config is config is aitune.engine.settings.settings\n"
        "from aitune.torch.jit import config as jit_config\n"
        "import aitune.engine.jit.settings\n"
        "assert jit_config is aitune.engine.jit.settings.settings\n"
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


def test_no_module_imports_a_private_name_of_another():
    """A name with a leading underscore is its module's own: another module that needs it gets a public one."""
    sources = [*ROOT.glob("aitune-*/src"), ROOT / "testkit" / "src", *ROOT.glob("examples/*/src")]
    found = []
    for path in (p for src in sources for p in src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or not (node.level or (node.module or "").startswith("aitune")):
                continue
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno} {alias.name}"
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__")
            ]
    assert not found, f"private names imported from another module: {found}"


PLUGIN_API = {
    "aitune.plugin",
    # what it re-exports from
    "aitune.backend",
    "aitune.registry",
    "aitune.executor",
    "aitune.graph",
    "aitune.tree",
    "aitune.tracing",
    "aitune.onnx_export",
    "aitune.validation",
    "aitune.errors",
    # what those import
    "aitune.report",
    "aitune.converter",
    "aitune.cachedir",
    "aitune.compile_cache",
    "aitune.envvars",
    "aitune.files",
    "aitune.distributed",
    "aitune.traced_branches",
    "aitune.state",
    "aitune.text",
    "aitune.tracer_output",
}
"""The core modules a backend or executor may reach through ``aitune.plugin``; the contract
``plugin-api-stays-below-the-engine`` forbids every other one, indirect imports included."""

PLUGIN_SOURCES = sorted(p.parent for p in ROOT.glob("aitune-*/src/*/__init__.py") if p.parts[-4] != "aitune-core")
PLUGIN_SOURCES += sorted(p.parent for p in ROOT.glob("examples/*/src/*/__init__.py"))
"""Every plugin distribution's package (and the deployment's): the sources of the plugin contracts."""


def _units(names: list[str]) -> set[str]:
    return {name.removesuffix(".**") for name in names}


def test_plugins_may_import_only_aitune_plugin_every_other_core_module_is_forbidden():
    """The allow-list written as a forbidden list: a new core module must be added to it."""
    listed = _listed("plugins-use-public-api", "forbidden_modules")
    allowed = {"aitune.plugin", "aitune.torch"}
    missing = (_core_modules() | {"aitune"}) - allowed - _units(listed)
    assert not missing, f"forbid these to plugins in plugins-use-public-api ({CONTRACTS.name}): {sorted(missing)}"
    packages = {f"aitune.{m.name}" for m in pkgutil.iter_modules(aitune.__path__) if m.ispkg} - allowed
    unopened = {p for p in packages if f"{p}.**" not in listed}
    assert not unopened, f"the contract matches modules, not packages: add each one's '.**' too: {sorted(unopened)}"
    assert _units(listed) & allowed == set(), "aitune.plugin and aitune.torch are what plugins may import"


def test_the_plugin_contracts_name_every_plugin_distribution():
    packages = {p.name for p in PLUGIN_SOURCES}
    sources = _listed("plugins-use-public-api", "source_modules")
    assert set(sources) == packages | {f"{p}.**" for p in packages}
    engines = {"aitune_serve_ray", "aitune_serve_kserve"}  # users of ait.*, which reaches everything
    assert set(_listed("plugin-api-stays-below-the-engine", "source_modules")) == packages - engines


def test_what_plugins_reach_is_the_plugin_api_every_other_core_module_is_forbidden():
    contract = _contract("plugin-api-stays-below-the-engine")
    assert contract["allow_indirect_imports"].strip() == "False"
    forbidden = set(contract["forbidden_modules"].split())
    missing = _core_modules() - PLUGIN_API - forbidden
    assert not missing, (
        f"forbid these in plugin-api-stays-below-the-engine ({CONTRACTS.name}), or add them to PLUGIN_API "
        f"if aitune.plugin needs them: {sorted(missing)}"
    )
    assert not forbidden & PLUGIN_API, sorted(forbidden & PLUGIN_API)
    assert not PLUGIN_API - _core_modules(), f"gone from core: {sorted(PLUGIN_API - _core_modules())}"


def _names_imported_from_aitune_plugin(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "aitune.plugin":
            names |= {alias.name for alias in node.names}
    return names


def _plugin_files() -> list[Path]:
    tests = [p.parent.parent / "tests" for p in PLUGIN_SOURCES]
    return [f for folder in [*PLUGIN_SOURCES, *tests] if folder.is_dir() for f in sorted(folder.rglob("*.py"))]


def test_every_name_a_plugin_imports_is_exported_by_aitune_plugin():
    """Also the imports a CPU never runs (a GPU backend's build) and those in the plugin guide's examples."""
    used = {name: path for path in _plugin_files() for name in _names_imported_from_aitune_plugin(path.read_text())}
    guide = ROOT / "docs" / "plugins.md"
    for block in re.findall(r"```python\n(.*?)```", guide.read_text(encoding="utf-8"), flags=re.S):
        used.update(dict.fromkeys(_names_imported_from_aitune_plugin(block), guide))
    assert len(used) > 20, "the scan finds the plugins' imports"
    missing = {name: str(path.relative_to(ROOT)) for name, path in used.items() if name not in aitune.plugin.__all__}
    assert not missing, f"export these from aitune.plugin (and document them there): {missing}"


def test_aitune_plugin_exports_what_it_names_and_documents_each_name():
    module = aitune.plugin
    absent = [name for name in module.__all__ if not hasattr(module, name)]
    assert not absent, absent
    undocumented = [name for name in module.__all__ if not re.search(rf"\b{re.escape(name)}\b", module.__doc__ or "")]
    assert not undocumented, f"say in aitune.plugin's docstring what these are for: {undocumented}"


def test_plugins_import_aitune_only_through_aitune_plugin():
    """lint-imports checks this too; here it runs with the tests, on the plugins' files themselves."""
    allowed = {"aitune.plugin", "aitune.torch", "aitune.torch.serving"}  # the last: what serving engines share
    strays = []
    for path in (f for folder in PLUGIN_SOURCES for f in sorted(folder.rglob("*.py"))):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            modules += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            strays += [
                f"{path.relative_to(ROOT)}:{node.lineno} {m}"
                for m in modules
                if (m == "aitune" or m.startswith("aitune.")) and m not in allowed
            ]
    assert not strays, f"import these through aitune.plugin: {strays}"


def _module_private_names() -> set[str]:
    """The private attributes and methods ``ait.Module`` defines itself (not torch's)."""
    tree = ast.parse((CORE / "engine" / "module.py").read_text(encoding="utf-8"))
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Module"]
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(cls):  # object.__setattr__(self, "_name", ...)
        setter = isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "__setattr__" and len(node.args) > 1
        if setter and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            names.add(node.args[1].value)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_reaches_into_an_ait_module_s_private_state():
    """What other modules need of an ``ait.Module`` (how to put a call in the graph's form, holding a
    decision, keeping warnings while aitune times it) is public; its private attributes are its own."""
    private = _module_private_names()
    assert "_dispatcher" in private, private  # the scan still sees what it guards
    found = []
    for path in CORE.rglob("*.py"):
        if path == CORE / "engine" / "module.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            own = (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            )
            if isinstance(node, ast.Attribute) and node.attr in private and not own:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not found, f"private attributes of ait.Module read elsewhere: {found}"
