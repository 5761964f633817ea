"""Plugin discovery, registration and filtering, through real and fake installed distributions."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import warnings

import pytest

from aitune.errors import DuplicateBackendError, PluginError, PluginLoadError
from aitune.plugins import AituneManager
from aitune.registry import BackendSpec

GOOD_PLUGIN = """
from aitune import hookimpl
from aitune.registry import BackendSpec

@hookimpl
def aitune_register_backends(registry):
    registry.add(BackendSpec(name="{name}", backend_class="aitune.builtin.eager:TorchEagerBackend",
                             config_class="aitune.builtin.eager:TorchEagerBackendConfig"))
"""


def fresh() -> AituneManager:
    manager = AituneManager()
    manager.load_entry_points()
    return manager


def test_installed_members_are_discovered_through_entry_points():
    eps = {ep.name: ep.dist.name for ep in importlib.metadata.entry_points(group="aitune")}
    manager = fresh()
    for ep_name, dist in eps.items():
        assert manager.plugins[ep_name].distribution == dist
        assert manager.plugins[ep_name].error is None
    assert manager.registry.distribution("torch_eager") == "aitune-core"
    if "onnxruntime" in eps:
        assert manager.registry.distribution("onnxruntime") == "aitune-backend-onnxruntime"


def test_loading_is_idempotent():
    manager = fresh()
    before = manager.registry.names()
    manager.load_entry_points()
    manager.register(sys.modules["aitune.builtin.eager"], name="aitune.builtin.eager", distribution="aitune-core")
    assert manager.registry.names() == before


def test_broken_plugin_is_skipped_with_a_warning_naming_it(fake_distribution):
    fake_distribution("broken-aitune-plugin", "broken_plugin", "raise ImportError('no such runtime: libfoo')")
    with pytest.warns(RuntimeWarning, match=r"broken-aitune-plugin 9\.9\.9.*ImportError: no such runtime: libfoo"):
        manager = fresh()
    assert "torch_eager" in manager.registry.names()
    [failed] = manager.failed_plugins()
    assert failed.distribution == "broken-aitune-plugin" and "libfoo" in failed.error


def test_strict_mode_raises_on_a_broken_plugin(fake_distribution, monkeypatch):
    fake_distribution("broken-aitune-plugin", "broken_plugin", "raise RuntimeError('boom')")
    monkeypatch.setenv("AITUNE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match="broken-aitune-plugin.*boom.*AITUNE_STRICT_PLUGINS"):
        fresh()


def test_duplicate_backend_name_names_both_distributions(fake_distribution):
    fake_distribution("third-party-eager", "dup_plugin", GOOD_PLUGIN.format(name="torch_eager"))
    with pytest.warns(RuntimeWarning, match="registered by both aitune-core and third-party-eager"):
        manager = fresh()
    assert manager.registry.distribution("torch_eager") == "aitune-core"


def test_duplicate_backend_registration_raises_directly():
    manager = AituneManager()

    class Plugin:
        from aitune import hookimpl

        @hookimpl
        def aitune_register_backends(self, registry):
            registry.add(BackendSpec(name="torch_eager", backend_class="x:Y", config_class="x:Z"))

    with pytest.raises(DuplicateBackendError, match="both aitune-core and my-dist"):
        manager.register(Plugin(), name="dup", distribution="my-dist")
    assert "dup" not in manager.plugins


def test_disable_and_load_filters(fake_distribution, monkeypatch):
    fake_distribution("extra-backend", "extra_plugin", GOOD_PLUGIN.format(name="extra"))
    assert "extra" in fresh().registry.names()
    monkeypatch.setenv("AITUNE_DISABLE_PLUGINS", "extra-backend")
    assert "extra" not in fresh().registry.names()
    monkeypatch.delenv("AITUNE_DISABLE_PLUGINS")
    monkeypatch.setenv("AITUNE_LOAD_PLUGINS", "extra_plugin")
    manager = fresh()
    assert set(manager.registry.names()) == {"torch_eager", "extra"}


def test_registering_something_that_is_not_a_spec_is_refused():
    manager = AituneManager()

    class Plugin:
        from aitune import hookimpl

        @hookimpl
        def aitune_register_backends(self, registry):
            registry.add({"name": "x"})

    with pytest.raises(PluginError, match="not a BackendSpec"):
        manager.register(Plugin(), name="bad", distribution="bad-dist")


def test_missing_requirement_is_reported_without_importing(aitune_manager, register_plugin):
    class Plugin:
        from aitune import hookimpl

        @hookimpl
        def aitune_register_backends(self, registry):
            registry.add(
                BackendSpec(
                    name="needs_runtime",
                    backend_class="nowhere:Backend",
                    config_class="nowhere:Config",
                    requirements=["definitely-not-installed-runtime>=1"],
                    install_hint="pip install 'my-plugin[runtime]'",
                )
            )

    register_plugin(Plugin(), distribution="my-plugin")
    status = aitune_manager.registry.status("needs_runtime")
    assert not status.available
    assert "definitely-not-installed-runtime is not installed" in status.reason()
    assert "pip install 'my-plugin[runtime]'" in status.reason()


def test_import_aitune_torch_imports_no_backend_runtime():
    code = (
        "import sys, aitune, aitune.torch, aitune.torch.backend\n"
        "from aitune.plugins import get_manager\n"
        "m = get_manager(); [m.registry.status(n) for n in m.registry.names()]\n"
        "heavy = ('tensorrt', 'torch_tensorrt', 'onnxruntime', 'torchao', 'modelopt', 'triton', 'onnx')\n"
        "print(','.join(h for h in heavy if h in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_first_party_name_without_its_distribution_says_what_to_install(aitune_manager, monkeypatch):
    import aitune.torch.backend as backend_module
    from aitune.plugins import set_manager

    monkeypatch.setenv("AITUNE_DISABLE_PLUGINS", "aitune-backend-tensorrt")
    set_manager(fresh())
    monkeypatch.delitem(backend_module.__dict__, "TensorRTBackend", raising=False)
    with pytest.raises(ModuleNotFoundError, match="pip install aitune-backend-tensorrt"):
        from aitune.torch.backend import TensorRTBackend  # noqa: F401


def test_plugin_class_names_resolve_lazily(aitune_manager):
    import aitune.torch.backend as backend_module

    names = aitune_manager.registry.public_names()
    if "ONNXRuntimeBackend" not in names:
        pytest.skip("aitune-backend-onnxruntime is not installed")
    from aitune.torch.backend import ONNXRuntimeBackend

    assert ONNXRuntimeBackend.name == "onnxruntime"
    assert "ONNXRuntimeBackend" in dir(backend_module)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchBackend'"):
        backend_module.NoSuchBackend  # noqa: B018


def test_unknown_backend_name_lists_installed(aitune_manager):
    from aitune.errors import BackendNotFoundError

    with pytest.raises(BackendNotFoundError, match="torch_eager"):
        aitune_manager.registry.spec("nope")


def test_warning_free_default_load():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh()
