"""``ait.LoadOptions``: every ``ait.load`` option as one checked value, which ``ait.load`` and each
serving engine take, and which a config file's mapping reads back as the same value."""

from __future__ import annotations

import pytest
import torch
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune.errors import ArtifactError
from aitune.testing.backends import ToyBackend, ToyConfig

DATA = [torch.randn(2, 8), torch.randn(4, 8)]


@pytest.fixture
def saved(toy_backends, tmp_path):
    strategy = ait.OneBackendStrategy(ToyBackend(ToyConfig())).enable_performance_validation(False)
    model = ait.Module(SlowModule(delay_s=0.0), "m", strategy=strategy)
    ait.tune(model, DATA)
    return ait.save(model, tmp_path / "model.ait")


def _fresh():
    return ait.Module(SlowModule(delay_s=0.0), "m")


def test_options_are_the_keyword_arguments_as_one_value(saved):
    for options in (ait.LoadOptions(freeze=False), {"freeze": False}):
        model = ait.load(_fresh(), saved, options=options)
        assert model.state == "tuned"
        assert all(p.requires_grad for p in model.parameters()), "freeze=False came through options"
    frozen = ait.load(_fresh(), saved, options=ait.LoadOptions())
    assert not any(p.requires_grad for p in frozen.parameters())


def test_a_pin_given_through_options_is_checked(saved):
    with pytest.raises(ArtifactError, match="SHA-256|sha256|digest"):
        ait.load(_fresh(), saved, options=ait.LoadOptions(expected_sha256="0" * 64))


def test_options_and_keyword_arguments_together_are_refused(saved):
    with pytest.raises(ValueError, match="options= and check"):
        ait.load(_fresh(), saved, check=False, options=ait.LoadOptions(freeze=False))


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"fallback": "cpu"}, "fallback must be one of None, 'eager'"),
        ({"weights": "latest"}, "weights must be one of"),
        ({"expected_sha256": "abc"}, "64 hexadecimal digits"),
        ({"check": "yes"}, "check must be True, False or None"),
        ({"trust_native_code": 1}, "trust_native_code must be True or False"),
        ({"verify": True}, "unknown load option 'verify'; ait.load takes: check, device_map"),
    ],
)
def test_bad_options_say_what_is_allowed(given, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ait.LoadOptions.of(given)


def test_the_mapping_form_reads_back_as_the_same_options():
    options = ait.LoadOptions(
        device_map={"encoder": "cpu"}, trusted_keys=["keys/a.pem"], check=True, fallback="eager", freeze=False
    )
    assert options.to_json() == {
        "device_map": {"encoder": "cpu"},
        "trusted_keys": ["keys/a.pem"],
        "check": True,
        "fallback": "eager",
        "freeze": False,
    }
    assert ait.LoadOptions.of(options.to_json()) == options
    assert ait.LoadOptions.of(None) == ait.LoadOptions() and ait.LoadOptions().to_json() == {}
