"""``ait.config`` and ``aitune.torch.jit.config``: every assignment is checked, the environment is read on reset."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

import aitune.torch as ait
from aitune.testing.backends import ToyBackend
from aitune.torch import FirstWinsStrategy
from aitune.torch import jit as ait_jit

DOCS = Path(__file__).resolve().parents[2] / "docs"

BAD_CORE_VALUES = [
    ("max_samples", 0, "an int >= 1"),
    ("max_samples", "8", "an int >= 1"),
    ("max_samples", True, "an int >= 1"),
    ("fail_fast", 1, "True or False"),
    ("freeze", "no", "True or False"),
    ("show_progress", "auto", "True, False or None"),
    ("default_strategy", FirstWinsStrategy([ToyBackend()]), "a callable that makes a TuneStrategy, or None"),
]


@pytest.mark.parametrize(("name", "value", "expected"), BAD_CORE_VALUES)
def test_a_bad_core_setting_fails_where_it_is_set_and_changes_nothing(name, value, expected):
    before = getattr(ait.config, name)
    with pytest.raises(ValueError, match=re.escape(f"ait.config.{name} must be {expected}, got {value!r}")):
        setattr(ait.config, name, value)
    assert getattr(ait.config, name) == before


BAD_JIT_VALUES = [
    ("strategy", "FirstWinsStrategy", "a TuneStrategy or None"),
    ("backends", ["onnxruntime", ""], "a sequence of non-empty strings or None"),
    ("exclude", None, "a sequence of non-empty strings"),
    ("min_samples", 0, "an int >= 1"),
    ("max_depth", -1, "an int >= 0"),
    ("min_parameters", 1.5, "an int >= 0"),
    ("detect_graph_breaks", None, "True or False"),
    ("deferred", "yes", "True or False"),
    ("remember", 0, "True or False"),
    ("mode", "later", "one of background, inline"),
    ("max_tuning_share", 1.5, "a number in (0, 1]"),
    ("max_tuning_share", True, "a number in (0, 1]"),
]


@pytest.mark.parametrize(("name", "value", "expected"), BAD_JIT_VALUES)
def test_a_bad_jit_setting_fails_where_it_is_set_and_changes_nothing(name, value, expected):
    before = getattr(ait_jit.config, name)
    with pytest.raises(ValueError, match=re.escape(f"aitune.torch.jit.config.{name} must be {expected}, got ")):
        setattr(ait_jit.config, name, value)
    assert getattr(ait_jit.config, name) == before


@pytest.mark.parametrize("config", [ait.config, ait_jit.config], ids=["core", "jit"])
def test_a_misspelt_setting_is_refused_with_the_names(config):
    names = sorted(field.name for field in attrs.fields(type(config)))
    message = f"{config.public_name} has no setting 'max_sample'; the settings are {names}"
    with pytest.raises(AttributeError, match=re.escape(message)):
        config.max_sample = 3


def test_names_and_shares_are_stored_in_one_form():
    with ait_jit.config.patch(backends=["onnxruntime", "torch_inductor_jit"], exclude="Dropout", max_tuning_share=1):
        assert ait_jit.config.backends == ("onnxruntime", "torch_inductor_jit")
        assert ait_jit.config.exclude == ("Dropout",), "one name is a prefix, not a sequence of letters"
        assert ait_jit.config.max_tuning_share == 1.0 and isinstance(ait_jit.config.max_tuning_share, float)


def test_patch_restores_and_reset_returns_to_the_defaults():
    with ait.config.patch(max_samples=3, fail_fast=True):
        assert (ait.config.max_samples, ait.config.fail_fast) == (3, True)
    assert (ait.config.max_samples, ait.config.fail_fast) == (8, False)
    with pytest.raises(ValueError, match="max_samples"), ait.config.patch(freeze=False, max_samples=-1):
        pass
    assert (ait.config.max_samples, ait.config.freeze) == (8, True), "a refused patch leaves nothing behind"
    try:
        ait.config.show_progress = False
        ait.config.default_strategy = FirstWinsStrategy
        ait.config.reset()
        assert (ait.config.show_progress, ait.config.default_strategy) == (None, None)
    finally:
        ait.config.reset()


def test_each_jit_setting_but_the_strategy_has_its_environment_variable(monkeypatch):
    variables = {
        field.name: field.metadata["env"].name for field in attrs.fields(type(ait_jit.config)) if field.metadata
    }
    assert variables == {
        name: f"AITUNE_JIT_{name.upper()}" for name in attrs.fields_dict(type(ait_jit.config)) if name != "strategy"
    }
    assert not any(field.metadata for field in attrs.fields(type(ait.config))), "ait.config reads no environment"
    monkeypatch.setenv("AITUNE_JIT_BACKENDS", " onnxruntime , torch_inductor_jit,")
    monkeypatch.setenv("AITUNE_JIT_MIN_PARAMETERS", "1_000")
    monkeypatch.setenv("AITUNE_JIT_REMEMBER", "off")
    monkeypatch.setenv("AITUNE_JIT_DETECT_GRAPH_BREAKS", "False")
    try:
        ait_jit.config.reset()
        assert ait_jit.config.backends == ("onnxruntime", "torch_inductor_jit")
        assert (ait_jit.config.min_parameters, ait_jit.config.remember) == (1000, False)
        assert ait_jit.config.detect_graph_breaks is False
    finally:
        monkeypatch.undo()
        ait_jit.config.reset()
    assert (ait_jit.config.backends, ait_jit.config.min_parameters, ait_jit.config.remember) == (None, 100_000, True)


@pytest.mark.parametrize(
    ("variable", "raw", "message"),
    [
        (
            "AITUNE_JIT_DEFERRED",
            "maybe",
            "AITUNE_JIT_DEFERRED='maybe' is not a switch aitune understands; set it to one of 1, true, yes, on",
        ),
        ("AITUNE_JIT_MAX_DEPTH", "two", "AITUNE_JIT_MAX_DEPTH='two' is not an integer"),
        ("AITUNE_JIT_MAX_TUNING_SHARE", "half", "AITUNE_JIT_MAX_TUNING_SHARE='half' is not a number"),
        ("AITUNE_JIT_MIN_SAMPLES", "0", "AITUNE_JIT_MIN_SAMPLES='0': aitune.torch.jit.config.min_samples must be"),
        ("AITUNE_JIT_MODE", "later", "AITUNE_JIT_MODE='later': aitune.torch.jit.config.mode must be one of"),
    ],
)
def test_a_bad_environment_variable_is_named(monkeypatch, variable, raw, message):
    monkeypatch.setenv(variable, raw)
    try:
        with pytest.raises(ValueError, match=re.escape(message)):
            ait_jit.config.reset()
    finally:
        monkeypatch.undo()
        ait_jit.config.reset()


@pytest.mark.parametrize(("config", "doc"), [(ait.config, "settings.md"), (ait_jit.config, "jit.md")])
def test_every_setting_is_documented(config, doc):
    text = (DOCS / doc).read_text(encoding="utf-8")
    for field in attrs.fields(type(config)):
        assert f"| `{field.name}` | `{field.default!r}` |" in text, f"{doc} lists {field.name} with its default"
