"""docs/security.md names the test that holds each promise: every test it names must exist.

A promise whose test was renamed or deleted is a promise nobody checks any more; this fails first.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _defined_tests() -> set[str]:
    names: set[str] = set()
    files = [*ROOT.glob("**/tests/**/test_*.py"), *ROOT.glob("aitune-core/src/aitune/testing/*.py")]
    for path in files:
        if ".nox" in path.parts or ".venv" in path.parts:
            continue
        names.update(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", path.read_text(encoding="utf-8"), re.M))
    return names


def test_every_test_docs_security_names_exists():
    text = (ROOT / "docs" / "security.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(test_\w+)(?:\[[^\]`]*\])?`", text))  # a test, with its parameters; not a test_x.py
    assert len(named) > 40, "docs/security.md names the tests of its promises"
    missing = sorted(named - _defined_tests())
    assert not missing, f"docs/security.md names tests that do not exist: {missing}"
