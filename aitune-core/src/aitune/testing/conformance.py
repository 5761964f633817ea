"""``BackendConformance``: the contract tests every backend's own test suite inherits.

Subclass it, set ``backend_name`` and, where needed, override ``make_backend``, ``make_module``
or ``make_samples`` (a CNN backend tests on images, not on the default 2-D MLP)::

    class TestMyBackend(BackendConformance):
        backend_name = "my_backend"

        def make_module(self):
            return MyCNN().eval()

        def make_samples(self):
            return [Sample((torch.randn(b, 3, 32, 32),)) for b in (2, 4)]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
import torch

from .. import tree
from ..backend import Backend, BuildContext, LoadContext
from ..graph import GraphSpec, Sample, infer_graph
from ..session import Session
from .compare import assert_matches_eager

if TYPE_CHECKING:
    from ..plugins import AituneManager

HEAVY_RUNTIMES = ("tensorrt", "torch_tensorrt", "onnxruntime", "torchao", "modelopt", "triton")


class TinyMLP(torch.nn.Module):
    """A deterministic two-layer MLP: small enough for every test, big enough to be a real graph."""

    def __init__(self, features: int = 16, hidden: int = 32, out: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc1 = torch.nn.Linear(features, hidden)
        self.fc2 = torch.nn.Linear(hidden, out)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def tiny_samples(batch_sizes: tuple[int, ...] = (2, 4), features: int = 16, device: str = "cpu") -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    return [Sample((torch.randn(b, features, generator=g).to(device),)) for b in batch_sizes]


class BackendConformance:
    """Contract tests for one backend: registration, config JSON, light probe, build/save/load."""

    backend_name: ClassVar[str] = ""
    device: ClassVar[str] = "cpu"

    # -- what subclasses may override -------------------------------------------------------

    def manager(self) -> AituneManager:
        """The plugins these tests run with: the process's, as a user's ``ait.tune`` sees them.
        Override it to test a backend registered on a manager of your own."""
        from ..plugins import get_manager

        return get_manager()

    def session(self) -> Session:
        """The run these tests work in, from :meth:`manager`."""
        return self.manager().session()

    def make_backend(self) -> Backend:
        return self.session().registry.backend_class(self.backend_name)()

    def make_module(self) -> torch.nn.Module:
        return TinyMLP().eval().to(self.device)

    def make_samples(self) -> list[Sample]:
        return tiny_samples(device=self.device)

    # -- helpers ----------------------------------------------------------------------------

    def _graph(self, module: torch.nn.Module, samples: list[Sample]) -> GraphSpec:
        with torch.no_grad():
            outputs = [module(*s.args, **s.kwargs) for s in samples]
        return infer_graph(samples, ["x"], outputs=outputs)

    def _require_available(self) -> None:
        reason = self.session().registry.unavailable(self.backend_name, torch.device(self.device))
        if reason:
            pytest.skip(f"{self.backend_name} cannot run on {self.device} here: {reason}")

    # -- the contract -----------------------------------------------------------------------

    def test_registered_under_its_name(self) -> None:
        registry = self.session().registry
        assert self.backend_name in registry.names(), f"{self.backend_name!r} is not registered"
        backend_class = registry.backend_class(self.backend_name)
        assert issubclass(backend_class, Backend)
        assert backend_class.name == self.backend_name
        assert registry.config_class(self.backend_name) is backend_class.config_class

    def test_config_json_round_trip(self) -> None:
        registry = self.session().registry
        config = self.make_backend().config
        data = json.loads(json.dumps(registry.config_to_json(config, self.backend_name)))
        assert data["backend"] == self.backend_name
        assert registry.config_from_json(data) == config

    def test_a_config_from_a_file_calls_and_imports_nothing(self) -> None:
        """Each config field given callables, names of callables and modules, ``_type`` objects and
        dtypes by name, as a crafted artifact would: refused or kept as plain data, nothing called or
        imported (see :mod:`aitune.testing.hostile`)."""
        from .hostile import config_problems

        problems = config_problems(self.session().registry, self.backend_name)
        assert not problems, f"{self.backend_name}'s config read from a file: " + "; ".join(problems[:8])

    def test_probe_imports_no_runtime(self) -> None:
        code = textwrap.dedent(
            f"""
            import sys
            from aitune.plugins import get_manager
            get_manager().registry.status({self.backend_name!r})
            print(",".join(m for m in {HEAVY_RUNTIMES!r} if m in sys.modules))
            """
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "", f"checking availability imported: {out.stdout.strip()}"

    def test_build_infer_save_load(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        from ..validation import validate

        self._require_available()
        monkeypatch.setenv("AITUNE_BUILD_CACHE", "0")  # a cache hit would pass without building
        module, samples = self.make_module(), self.make_samples()
        graph = self._graph(module, samples)
        backend = self.make_backend()
        context = BuildContext(graph, samples, torch.device(self.device), tmp_path / "work", tmp_path / "cache")
        context.workdir.mkdir()
        context.cache_dir.mkdir()
        refusal = backend.unsupported_reason(graph, context.device)
        assert refusal is None, (
            f"{self.backend_name} refuses the conformance graph ({refusal}); override make_module and "
            "make_samples with a module and inputs it supports"
        )
        session = self.session()
        hook = session.hook
        before = module_state(module)
        with torch.no_grad():
            built = hook.aitune_build(backend=backend, module=module, context=context, session=session)
        changes = state_changes(before, module_state(module))
        assert not changes, f"build() changed the user's module (copy it before transforming): {'; '.join(changes)}"
        with torch.no_grad():
            report = validate(built, module, samples, graph)
        assert report.passed, report.reason

        payload = tmp_path / "payload"
        payload.mkdir()
        metadata = hook.aitune_serialize(backend=built, directory=payload, session=session)
        assert isinstance(json.loads(json.dumps(metadata)), dict), "save() must return JSON-able metadata"
        fresh = type(built)(built.config)
        load_ctx = LoadContext(graph, torch.device(self.device), metadata, tmp_path / "cache")
        with torch.no_grad():
            loaded = hook.aitune_deserialize(
                backend=fresh, module=module, directory=payload, context=load_ctx, session=session
            )
            for s in samples:
                want = tree.flatten(built.infer(*s.args, **s.kwargs))[0]
                got = tree.flatten(loaded.infer(*s.args, **s.kwargs))[0]
                for w, g in zip(want, got):
                    assert_matches_eager(g, w)

    def test_refit_takes_new_weights_or_declines(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """``refit`` either says it cannot (False) or leaves the backend computing eager's answer with
        the new weights; a backend that follows the live weights needs neither."""
        from ..validation import validate

        self._require_available()
        monkeypatch.setenv("AITUNE_BUILD_CACHE", "0")
        module, samples = self.make_module(), self.make_samples()
        graph = self._graph(module, samples)
        context = BuildContext(graph, samples, torch.device(self.device), tmp_path / "work", tmp_path / "cache")
        context.workdir.mkdir()
        context.cache_dir.mkdir()
        session = self.session()
        with torch.no_grad():
            built = session.hook.aitune_build(
                backend=self.make_backend(), module=module, context=context, session=session
            )
            for p in module.parameters():
                p.mul_(-0.5)  # new weights, as a fine-tune would bring
            if built.follows_weights() or not built.refit(module.state_dict()):
                return
            report = validate(built, module, samples, graph)
        assert report.passed, (
            f"refit() said it took the new weights, but the outputs differ from eager: {report.reason}"
        )
        assert built.build_info.get("refitted") is True, 'refit() must set build_info["refitted"] = True'


def module_state(module: torch.nn.Module) -> dict[str, Any]:
    """What a user sees of a module: submodule types and modes, every tensor's values and layout."""
    tensors = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        layout = (t.dtype, t.device, tuple(t.shape), t.stride(), t.requires_grad)
        tensors[name] = (layout, t.detach().clone())
    return {
        "modules": {name: (type(m).__name__, m.training) for name, m in module.named_modules()},
        "tensors": tensors,
    }


def state_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """How ``after`` differs from ``before`` (both from :func:`module_state`), in words."""
    changes = []
    for name in sorted(set(before["modules"]) | set(after["modules"])):
        was, now = before["modules"].get(name), after["modules"].get(name)
        if was is None or now is None or was[0] != now[0]:
            changes.append(f"submodule {name or '(root)'} is now {now and now[0]}, was {was and was[0]}")
        elif was[1] != now[1]:
            changes.append(f"{name or '(root)'} switched to {'training' if now[1] else 'eval'} mode")
    for name in sorted(set(before["tensors"]) | set(after["tensors"])):
        was, now = before["tensors"].get(name), after["tensors"].get(name)
        if was is None or now is None:
            changes.append(f"tensor {name} was {'added' if was is None else 'removed'}")
        elif was[0] != now[0]:
            changes.append(f"tensor {name} changed dtype, device, shape, memory format or requires_grad")
        elif not torch.equal(was[1], now[1]):  # the same storage untouched: exact equality is right here
            changes.append(f"tensor {name} changed values")
    return changes


def run_in_fresh_process(code: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> Any:
    """Run ``code`` in a new interpreter and return what it printed as JSON on its last line."""
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            cwd=cwd or tmp,
            env=env,
        )
    if result.returncode != 0:
        raise AssertionError(f"fresh process failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
