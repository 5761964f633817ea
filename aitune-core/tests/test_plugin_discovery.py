"""Entry points load when first needed: a backend looked up by name loads its own plugin, a listing
loads them all, and a manager that never looked for entry points loads none (issue 56 item 3)."""

from __future__ import annotations

import sys

import pytest

from aitune.errors import PluginLoadError
from aitune.plugins import AituneManager

PLUGIN = """
from aitune import hookimpl
from aitune.builtin.eager import TorchEagerBackend
from aitune.registry import BackendSpec

class Plain(TorchEagerBackend):
    name = "{name}"

@hookimpl
def aitune_register_backends(registry):
    registry.add(BackendSpec(backend_class=__name__ + ":Plain"))
"""


@pytest.fixture
def two_plugins(fake_distribution, monkeypatch):
    """Two installed plugins, each declaring one backend; their modules are forgotten afterwards."""
    fake_distribution("disc-alpha", "disc_alpha", PLUGIN.format(name="disc_alpha"))
    fake_distribution("disc-beta", "disc_beta", PLUGIN.format(name="disc_beta"))
    for module in ("disc_alpha", "disc_beta"):
        monkeypatch.delitem(sys.modules, module, raising=False)


def found() -> AituneManager:
    manager = AituneManager()
    manager.find_entry_points()
    return manager


def test_a_backend_looked_up_by_name_loads_its_plugin_and_no_other(two_plugins):
    manager = found()
    assert "disc_alpha" not in sys.modules, "finding reads metadata, imports nothing"
    assert manager.registry.distribution("disc_alpha") == "disc-alpha"
    assert "disc_alpha" in sys.modules and "disc_beta" not in sys.modules
    assert "disc_beta" in manager.registry.names(), "a listing loads every plugin"
    assert "disc_beta" in sys.modules


def test_the_plugin_table_loads_every_plugin(two_plugins):
    assert {"disc_alpha", "disc_beta"} <= set(found().plugins)


def test_the_hook_relay_loads_every_plugin_so_an_observer_sees_every_call(two_plugins):
    found().hook  # noqa: B018 (the property loads them)
    assert "disc_alpha" in sys.modules and "disc_beta" in sys.modules


def test_a_plugin_named_after_its_distribution_is_found_for_any_backend_it_declares(fake_distribution, monkeypatch):
    # named after its distribution and a word of the backend's name: found first
    fake_distribution("aitune-backend-gamma", "disc_gamma", PLUGIN.format(name="fast_gamma_aot"), ep_name="gamma")
    # named after its distribution and nothing of the backend's name: found by loading the rest
    fake_distribution("delta-tools", "disc_delta", PLUGIN.format(name="zeta"), ep_name="delta-tools")
    for module in ("disc_gamma", "disc_delta"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    manager = found()
    assert "fast_gamma_aot" in manager.registry and "disc_delta" not in sys.modules
    assert manager.registry.spec("zeta").name == "zeta"


def test_a_name_no_plugin_declares_is_refused_after_every_plugin_was_asked(two_plugins):
    manager = found()
    assert "no_such_backend" not in manager.registry
    assert {"disc_alpha", "disc_beta"} <= set(manager.registry.names())


def test_a_manager_that_never_looked_for_entry_points_loads_none(two_plugins):
    manager = AituneManager()
    assert "disc_alpha" not in manager.registry
    assert "disc_alpha" not in manager.plugins and "disc_alpha" not in sys.modules


def test_a_broken_plugin_fails_when_it_is_first_needed(fake_distribution, monkeypatch):
    fake_distribution("disc-broken", "disc_broken", "raise RuntimeError('boom')")
    monkeypatch.setenv("AITUNE_STRICT_PLUGINS", "1")
    manager = found()  # found, not imported: nothing fails yet
    with pytest.raises(PluginLoadError, match="disc-broken.*boom"):
        manager.registry.names()
