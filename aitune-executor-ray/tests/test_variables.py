"""The Ray executor's AITUNE_RAY_* variables: read through aitune.envvars, listed in docs/settings.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aitune.errors import ConfigError
from aitune_executor_ray import executor

SETTINGS_DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_docs_list_every_variable_of_the_executor_with_its_default_and_no_other():
    text = SETTINGS_DOC.read_text(encoding="utf-8")
    docs = dict(re.findall(r"^\| `(AITUNE_RAY_\w+)` \| (.*?) \|", text, re.MULTILINE))
    declared = {variable.name: variable for variable in executor.VARIABLES}
    module_level = {v.name for v in vars(executor).values() if isinstance(v, type(executor.BUILD_CPUS))}
    assert module_level == set(declared), "VARIABLES lists every variable the module declares"
    assert set(docs) == set(declared)
    for name, variable in declared.items():
        if variable.default is not None:
            assert docs[name] == f"`{variable.default}`", f"{name}'s default in docs/settings.md"


def test_variables_are_read_when_used_and_a_bad_value_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("AITUNE_RAY_BUILD_CPUS", "0")
    with pytest.raises(ConfigError, match=r"AITUNE_RAY_BUILD_CPUS='0' must be a number > 0 \(CPUs per CPU build\)"):
        executor.build_cpus()
    monkeypatch.setenv("AITUNE_RAY_SHARED_DIR", f" {tmp_path} ")
    assert executor.shared_dir() == tmp_path, "blanks around it are dropped"
    monkeypatch.setenv("AITUNE_RAY_ACCELERATOR_TYPE", "A100")
    assert executor.local_accelerator() == "accelerator_type:A100", "the GPU model keeps its case"
    monkeypatch.setenv("AITUNE_RAY_SHARED_DIR", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="AITUNE_RAY_SHARED_DIR=.*missing' is not a folder"):
        executor.shared_dir()
