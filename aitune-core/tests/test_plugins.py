"""Plugin discovery, registration and filtering, through real and fake installed distributions."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import warnings

import pytest

from aitune import hookimpl
from aitune.builtin.eager import TorchEagerBackend, TorchEagerBackendConfig
from aitune.errors import DuplicateBackendError, PluginError, PluginLoadError
from aitune.plugins import AituneManager
from aitune.registry import BackendSpec

GOOD_PLUGIN = """
from aitune import hookimpl
from aitune.builtin.eager import TorchEagerBackend
from aitune.registry import BackendSpec

class Plain(TorchEagerBackend):
    name = "{name}"

@hookimpl
def aitune_register_backends(registry):
    registry.add(BackendSpec(backend_class=__name__ + ":Plain"))
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
            registry.add(BackendSpec(backend_class="aitune.builtin.eager:TorchEagerBackend"))

    with pytest.raises(DuplicateBackendError, match="both aitune-core and my-dist"):
        manager.register(Plugin(), name="dup", distribution="my-dist")
    assert "dup" not in manager.plugins


def test_disable_and_load_filters(fake_distribution, monkeypatch):
    fake_distribution("extra-backend", "extra", GOOD_PLUGIN.format(name="extra"))
    assert "extra" in fresh().registry.names()
    monkeypatch.setenv("AITUNE_DISABLE_PLUGINS", "extra-backend")
    assert "extra" not in fresh().registry.names()
    monkeypatch.delenv("AITUNE_DISABLE_PLUGINS")
    monkeypatch.setenv("AITUNE_LOAD_PLUGINS", "extra")
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


class NeedsRuntime(TorchEagerBackend):
    name = "needs_runtime"


def test_missing_requirement_is_reported_without_importing(aitune_manager, register_plugin):
    class Plugin:
        from aitune import hookimpl

        @hookimpl
        def aitune_register_backends(self, registry):
            registry.add(
                BackendSpec(
                    backend_class=f"{__name__}:NeedsRuntime",
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


class Disagreeing(TorchEagerBackend):
    name = "disagreeing"
    devices = ("cpu",)


@pytest.mark.parametrize(
    ("declared", "complaint"),
    [
        ({"name": "other"}, "name 'other' in the spec, 'disagreeing' on the class"),
        (
            {"config_class": "aitune.testing.backends:ToyConfig"},
            "config 'aitune.testing.backends:ToyConfig' in the spec",
        ),
        ({"devices": ("cuda",)}, "devices ['cuda'] in the spec, ['cpu'] on the class"),
    ],
)
def test_a_spec_that_disagrees_with_its_backend_class_is_refused(declared, complaint):
    class Plugin:
        @hookimpl
        def aitune_register_backends(self, registry):
            registry.add(BackendSpec(backend_class=f"{__name__}:Disagreeing", **declared))

    manager = AituneManager()
    with pytest.raises(PluginError, match=re.escape(complaint)):
        manager.register(Plugin(), name="disagreeing", distribution="my-dist")
    assert "disagreeing" not in manager.registry


def test_the_spec_takes_name_config_and_devices_from_the_class():
    class Plugin:
        @hookimpl
        def aitune_register_backends(self, registry):
            registry.add(BackendSpec(backend_class=f"{__name__}:Disagreeing"))

    manager = AituneManager()
    manager.register(Plugin(), name="disagreeing", distribution="my-dist")
    spec = manager.registry.spec("disagreeing")
    assert spec.devices == ("cpu",)
    assert manager.registry.config_class("disagreeing") is TorchEagerBackendConfig


@pytest.mark.parametrize(
    ("backend_class", "complaint"),
    [
        ("nowhere:Backend", "cannot be imported (ModuleNotFoundError"),
        ("aitune.builtin.eager:TorchEagerBackendConfig", "not a subclass of aitune.backend.Backend"),
    ],
)
def test_a_spec_whose_class_is_missing_or_not_a_backend_is_refused(backend_class, complaint):
    class Plugin:
        @hookimpl
        def aitune_register_backends(self, registry):
            registry.add(BackendSpec(backend_class=backend_class))

    with pytest.raises(PluginError, match=re.escape(complaint)):
        AituneManager().register(Plugin(), name="bad", distribution="bad-dist")


def test_an_entry_point_named_unlike_its_backend_is_refused(fake_distribution):
    fake_distribution("acme-tools", "misnamed_plugin", GOOD_PLUGIN.format(name="fast"), ep_name="acme")
    with pytest.warns(RuntimeWarning, match="entry point 'acme' of acme-tools registers the backend 'fast'"):
        manager = fresh()
    assert "fast" not in manager.registry


@pytest.mark.parametrize(
    ("dist", "ep", "backend"),
    [("acme-tools", "fast", "fast"), ("acme-tools", "acme", "acme_fast"), ("aitune-backend-acme", "acme", "fast")],
)
def test_an_entry_point_named_after_its_backend_or_distribution_loads(fake_distribution, dist, ep, backend):
    fake_distribution(dist, f"plugin_of_{backend}", GOOD_PLUGIN.format(name=backend), ep_name=ep)
    assert fresh().registry.distribution(backend) == dist


def test_a_backend_without_its_device_is_unavailable_there_whatever_the_probe_says(monkeypatch):
    import torch

    class Plugin:
        @hookimpl
        def aitune_register_backends(self, registry):
            registry.add(BackendSpec(backend_class=f"{__name__}:NeedsRuntime", probe=lambda device: None))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    manager = AituneManager()
    manager.register(Plugin(), name="needs_runtime", distribution="my-dist")
    status = manager.registry.status("needs_runtime")
    assert status.devices == {"cpu": None, "cuda": "no CUDA device is visible to torch"}
