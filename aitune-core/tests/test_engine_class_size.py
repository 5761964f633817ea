"""No class in the engine grows past about 250 lines: a class that does several jobs is split into
units with one job each (as graph tuning is, into its build, validate, profile and decide steps)."""

from __future__ import annotations

import ast
from pathlib import Path

import aitune.engine

LIMIT = 250
"""The most lines a class of ``aitune/engine/`` may span, from ``class`` to the end of its body."""

ENGINE = Path(aitune.engine.__file__).parent


def class_sizes(source: str) -> dict[str, int]:
    """Each class of ``source`` (nested ones as ``Outer.Inner``) and the lines it spans."""
    sizes: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                assert child.end_lineno is not None
                sizes[name] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return sizes


def test_the_count_spans_a_class_from_its_class_line_to_the_end_of_its_body() -> None:
    source = (
        "@decorated\nclass A:\n    x = 1\n\n    class B:\n        y = 2\n\n\ndef f():\n    class C:\n        pass\n"
    )
    assert class_sizes(source) == {"A": 5, "A.B": 2, "C": 2}  # not its decorator


def test_no_engine_class_is_longer_than_the_limit() -> None:
    over = {
        f"{path.relative_to(ENGINE.parent)}: {name}": size
        for path in sorted(ENGINE.rglob("*.py"))
        for name, size in class_sizes(path.read_text(encoding="utf-8")).items()
        if size > LIMIT
    }
    assert not over, (
        f"engine classes over {LIMIT} lines: {over}; split each into units with one job each "
        "(docs/architecture.md, 'Graph tuning' shows how graph tuning was)"
    )
