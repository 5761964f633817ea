"""Every ``AITUNE_*`` variable is read through aitune.envvars, documented in docs/settings.md with its
default, and refused with a message naming it when it does not parse."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import attrs
import pytest

from aitune import envvars
from aitune.engine.jit.settings import JITSettings
from aitune.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = ROOT / "aitune-core" / "src" / "aitune" / "envvars.py"
HOOK = ROOT / "aitune-core" / "src" / "_aitune_jit_hook.py"
"""Runs at interpreter start when the .pth line finds AITUNE_JIT set: it checks the variable is more
than blanks before importing aitune (about 30 ms), the one exception with that .pth line."""
SOURCES = [*ROOT.glob("aitune-*/src"), ROOT / "testkit" / "src", *ROOT.glob("examples/*/src")]
SETTINGS_DOC = ROOT / "docs" / "settings.md"


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _aitune_name(node: ast.AST) -> bool:
    """A string constant, or an f-string's leading text, that starts with ``AITUNE_``."""
    if isinstance(node, ast.JoinedStr) and node.values:
        node = node.values[0]
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("AITUNE_")


def _key_read(node: ast.AST) -> ast.AST | None:
    """The key ``node`` reads from the environment, or None when it reads none."""
    if isinstance(node, ast.Call) and node.args and isinstance(node.func, (ast.Attribute, ast.Name)):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id
        on_environ = isinstance(func, ast.Attribute) and _is_environ(func.value)
        if name == "getenv" or (on_environ and name in ("get", "pop", "setdefault")):
            return node.args[0]
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
        return node.slice
    if isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
        return node.left
    return None


def aitune_reads(source: str) -> list[int]:
    """The lines of ``source`` that read an ``AITUNE_`` variable straight from the environment:
    ``os.environ.get/pop/setdefault``, ``os.getenv``, ``os.environ[...]`` and ``... in os.environ``."""
    return sorted(
        node.lineno
        for node in ast.walk(ast.parse(source))
        if (key := _key_read(node)) is not None and _aitune_name(key)
    )


def test_the_scan_finds_every_way_of_reading_the_environment():
    source = (
        "import os\nfrom os import environ, getenv\n"
        "a = os.environ.get('AITUNE_A')\n"
        "b = os.getenv('AITUNE_B', '1')\n"
        "c = os.environ['AITUNE_C']\n"
        "d = 'AITUNE_D' in os.environ\n"
        "e = environ.get(f'AITUNE_{x}')\n"
        "f = getenv('AITUNE_F')\n"
        "g = os.environ.pop('AITUNE_G', None)\n"
        "os.environ['AITUNE_SET'] = '1'\n"  # writing one is no read
        "h = {**os.environ, 'AITUNE_JIT': '0'}\n"  # nor is handing a child its own value
        "i = os.environ.get('HOME')\n"
    )
    assert aitune_reads(source) == [3, 4, 5, 6, 7, 8, 9]


def test_no_aitune_variable_is_read_outside_envvars():
    files = [path for src in SOURCES for path in sorted(src.rglob("*.py"))]
    assert ALLOWED in files and len(files) > 100, "the scan covers every distribution's sources"
    stray = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in files
        if path not in (ALLOWED, HOOK)
        for line in aitune_reads(path.read_text(encoding="utf-8"))
    ]
    assert not stray, (
        f"read these through an aitune.envvars.Variable (declared there, listed in docs/settings.md): {stray}"
    )


def test_the_interpreter_start_gate_is_the_one_exception_and_reads_only_aitune_jit():
    pth = [path for src in SOURCES for path in src.rglob("*.pth")]
    assert [p.name for p in pth] == ["aitune_jit.pth"]
    assert set(re.findall(r"AITUNE_\w+", pth[0].read_text())) == {"AITUNE_JIT"}
    hook = HOOK.read_text(encoding="utf-8")
    assert len(aitune_reads(hook)) == 1 and 'os.environ.get("AITUNE_JIT"' in hook
    assert "JIT.get()" in hook, "the value itself is read through aitune.envvars"


def core_variables() -> dict[str, envvars.Variable]:
    """Every variable aitune.envvars declares, by the name the code uses (``ISOLATE``)."""
    return {name: value for name, value in vars(envvars).items() if isinstance(value, envvars.Variable)}


def jit_variables() -> dict[str, attrs.Attribute]:
    return {field.metadata["env"].name: field for field in attrs.fields(JITSettings) if "env" in field.metadata}


def documented() -> dict[str, str]:
    """docs/settings.md's table rows: variable -> its default cell."""
    rows = re.findall(r"^\| `(AITUNE_\w+)` \| (.*?) \|", SETTINGS_DOC.read_text(encoding="utf-8"), re.MULTILINE)
    names = [name for name, _ in rows]
    assert len(names) == len(set(names)), "each variable has one row"
    return dict(rows)


def test_docs_list_every_variable_of_core_and_the_jit_with_its_default_and_no_other():
    docs = {name: cell for name, cell in documented().items() if not name.startswith("AITUNE_RAY_")}
    core = {v.name: v for v in core_variables().values()}
    jit = jit_variables()
    assert len(core) >= 16 and len(jit) == 11
    assert set(docs) == set(core) | set(jit), "docs/settings.md lists the variables the code declares"
    for name, variable in core.items():
        if variable.default is not None:
            assert docs[name] == f"`{variable.default}`", f"{name}'s default in docs/settings.md"
        else:
            assert not re.fullmatch(r"`[^`]*`", docs[name]), f"{name} has no fixed default: say how it is worked out"
    for name, field in jit.items():
        assert docs[name] == f"`{field.default!r}`", f"{name}'s default in docs/settings.md"


def test_every_declared_variable_is_read_somewhere():
    """A variable declared in aitune.envvars but used nowhere would be documented and do nothing."""
    used: set[str] = set()
    for path in (p for src in SOURCES for p in src.rglob("*.py") if p != ALLOWED):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("envvars"):
                used |= {alias.name for alias in node.names}
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "envvars":
                used.add(node.attr)
    assert set(core_variables()) - used == set()


def test_each_variable_is_read_when_used_and_blank_means_its_default(monkeypatch):
    monkeypatch.setenv("AITUNE_ISOLATE", "  ALL ")
    assert envvars.ISOLATE.get() == "all"
    monkeypatch.setenv("AITUNE_ISOLATE", "   ")
    assert envvars.ISOLATE.get() == "native"
    monkeypatch.delenv("AITUNE_BUILD_WORKERS", raising=False)
    assert envvars.BUILD_WORKERS.get() is None, "no fixed default: the reader works it out"
    monkeypatch.setenv("AITUNE_LOAD_PLUGINS", " extra, ,other ")
    assert envvars.LOAD_PLUGINS.get() == ("extra", "other")
    with pytest.raises(ValueError, match="HOME is not an aitune variable"):
        envvars.Variable("HOME", envvars.parse_path)


@pytest.mark.parametrize(
    ("variable", "raw", "message"),
    [
        (
            "OWN_KEY",
            "disabled",
            "AITUNE_OWN_KEY='disabled' is not a switch aitune understands; set it to one of 1, true",
        ),
        (
            "ISOLATE",
            "sometimes",
            "AITUNE_ISOLATE='sometimes' is not one of native, all, none; set one of them, or unset it for the default",
        ),
        (
            "BUILD_WORKERS",
            "-1",
            "AITUNE_BUILD_WORKERS='-1' is not a whole number >= 0 (how many builds may run beside the tune",
        ),
        ("BUILD_TIMEOUT_S", "0", "AITUNE_BUILD_TIMEOUT_S='0' must be a number > 0 (seconds), or unset it"),
        ("BUILD_MEMORY_MB", "nan", "AITUNE_BUILD_MEMORY_MB='nan' must be a number >= 0 (megabytes; 0: no cap)"),
        ("DISTRIBUTED_TIMEOUT_S", "soon", "AITUNE_DISTRIBUTED_TIMEOUT_S='soon' must be a number > 0 (seconds)"),
        ("DISTRIBUTED", "maybe", "AITUNE_DISTRIBUTED='maybe' is not one of auto, off"),
    ],
)
def test_a_value_that_does_not_parse_is_refused_naming_the_variable_and_what_works(monkeypatch, variable, raw, message):
    declared = getattr(envvars, variable)
    monkeypatch.setenv(declared.name, raw)
    with pytest.raises(ConfigError, match=re.escape(message)):
        declared.get()


def test_a_bad_rank_decision_from_the_environment_names_the_variable(monkeypatch):
    from aitune import distributed

    monkeypatch.setenv("AITUNE_RANK_DECISION", "fastest")
    with pytest.raises(ConfigError, match="AITUNE_RANK_DECISION='fastest' is not one of rank0, slowest"):
        distributed.rank_decision()
    assert distributed.rank_decision("Slowest") == "slowest", "the argument wins over the variable"
