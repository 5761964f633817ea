"""Configs go to and from JSON through one converter, tagged by backend name."""

from __future__ import annotations

import json

import attrs
import pytest

from aitune.backend import BackendConfig
from aitune.builtin.eager import TorchEagerBackend, TorchEagerBackendConfig
from aitune.errors import ConfigError
from aitune.registry import BackendSpec
from aitune.testing import config_from_json, config_to_json


@attrs.frozen(kw_only=True)
class NestedConfig:
    depth: int = attrs.field(default=1, validator=attrs.validators.ge(1))


@attrs.frozen(kw_only=True)
class ToyConfig(BackendConfig):
    mode: str = "fast"
    nested: NestedConfig = attrs.field(factory=NestedConfig)


class ToyBackend(TorchEagerBackend):
    name = "toy"
    config_class = ToyConfig


class ToyPlugin:
    from aitune import hookimpl

    @hookimpl
    def aitune_register_backends(self, registry):
        registry.add(BackendSpec(backend_class=f"{__name__}:ToyBackend"))


def test_round_trip_is_tagged_by_backend_name(register_plugin):
    register_plugin(ToyPlugin())
    config = ToyConfig(mode="small", nested=NestedConfig(depth=3))
    data = json.loads(json.dumps(config_to_json(config)))
    assert data == {"backend": "toy", "mode": "small", "nested": {"depth": 3}}
    assert config_from_json(data) == config
    assert config_from_json({"backend": "torch_eager"}) == TorchEagerBackendConfig()


def test_unknown_key_is_refused_with_its_path(register_plugin):
    register_plugin(ToyPlugin())
    with pytest.raises(ConfigError, match=r"extra fields found \(colour\) @ \$\.nested"):
        config_from_json({"backend": "toy", "nested": {"depth": 2, "colour": "red"}})


def test_validator_failure_names_the_path(register_plugin):
    register_plugin(ToyPlugin())
    with pytest.raises(ConfigError, match=r"\$\.nested"):
        config_from_json({"backend": "toy", "nested": {"depth": 0}})


def test_unknown_backend_and_missing_tag(aitune_manager):
    with pytest.raises(ConfigError, match="unknown backend 'nope'"):
        config_from_json({"backend": "nope"})
    with pytest.raises(ConfigError, match="'backend' key"):
        config_from_json({"mode": "fast"})


def test_config_of_an_unregistered_class_is_refused(aitune_manager):
    with pytest.raises(ConfigError, match="belongs to no registered backend"):
        config_to_json(ToyConfig())
