"""Configs, the availability probe, the cache location and the shapes each backend compiles for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from aitune.compile_cache import ENV, PRIVATE_OPTIONS, inductor_cache, inductor_cache_dir
from aitune.errors import ConfigError
from aitune.graph import Sample, infer_graph
from aitune.testing import config_from_json, config_to_json
from aitune_backend_inductor import plugin
from aitune_backend_inductor.config import TorchInductorAotBackendConfig, TorchInductorJitBackendConfig
from aitune_backend_inductor.shapes import trace_sizes, unseen_sizes, warmup_cases


def test_configs_round_trip_through_json_with_options() -> None:
    for config in (
        TorchInductorJitBackendConfig(options={"epilogue_fusion": False}, dynamic=True, fullgraph=True),
        TorchInductorJitBackendConfig(mode="max-autotune"),
        TorchInductorAotBackendConfig(options={"max_autotune": False}, strict=True),
    ):
        assert config_from_json(json.loads(json.dumps(config_to_json(config)))) == config
    assert hash(TorchInductorAotBackendConfig(options={"a": 1})) == hash(TorchInductorAotBackendConfig())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "fastest"}, "not a torch.compile mode"),
        ({"mode": "max-autotune", "options": {"max_autotune": True}}, "either mode"),
        ({"options": {"x": object()}}, "JSON values"),
        ({"options": {1: True}}, "string keys"),
    ],
)
def test_bad_jit_configs_say_what_to_change(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TorchInductorJitBackendConfig(**kwargs)


def test_the_jit_is_superseded_on_the_cpu_by_the_aot_backend_this_plugin_registers() -> None:
    """Among the default candidates the JIT is built on the CPU only where AOTInductor is not
    correct: the name it gives must be a backend this plugin declares for that device."""
    from aitune.registry import BackendRegistry
    from aitune_backend_inductor.jit import TorchInductorJitBackend

    registry = BackendRegistry()
    plugin.aitune_register_backends(registry)
    [name] = TorchInductorJitBackend().superseded_by(torch.device("cpu"))
    assert "cpu" in registry.spec(name).devices
    assert registry.backend_class(name)().superseded_by(torch.device("cpu")) == (), "no cycle: it is built"
    assert TorchInductorJitBackend().superseded_by(torch.device("cuda")) == (), "not measured on CUDA: built there"


def test_probe_names_a_missing_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    reason = plugin._probe("cpu")
    assert reason is not None and "no-such-c++" in reason and "not on PATH" in reason


def test_probe_accepts_the_compiler_inductor_uses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "my-c++"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    assert plugin._probe("cpu") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_probe_refuses_cuda_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "sh")  # any program on PATH stands in for the compiler
    assert plugin._probe("cuda") == "no CUDA device is visible to torch"


def test_cache_goes_under_aitunes_cache_unless_the_user_chose_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv(ENV, raising=False)
    assert inductor_cache_dir(tmp_path) == tmp_path / "inductor"
    monkeypatch.setenv(ENV, default_cache_dir())  # what Inductor writes there itself once it ran
    assert inductor_cache_dir(tmp_path) == tmp_path / "inductor"
    monkeypatch.setenv(ENV, str(tmp_path / "mine"))
    assert inductor_cache_dir(tmp_path) == tmp_path / "mine"


def test_cache_setting_is_restored_after_a_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import os

    monkeypatch.delenv(ENV, raising=False)
    with inductor_cache(tmp_path) as folder:
        assert os.environ[ENV] == str(folder) and folder.is_dir()
    assert ENV not in os.environ


def test_aitunes_inductor_cache_is_private_whatever_the_umask(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import os

    if not hasattr(os, "getuid"):
        pytest.skip("POSIX modes only")
    monkeypatch.delenv(ENV, raising=False)
    previous = os.umask(0)
    try:
        with inductor_cache(tmp_path) as folder:
            assert folder.stat().st_mode & 0o777 == 0o700
    finally:
        os.umask(previous)
    planted = folder / "fxgraph" / "planted"
    planted.parent.mkdir()
    planted.write_text("another user's compiled graph")
    folder.chmod(0o777)  # made by an older aitune under umask 000: anyone could have written it
    with pytest.warns(RuntimeWarning, match="not yours alone"), inductor_cache(tmp_path) as again:
        assert again == folder and not planted.exists() and folder.stat().st_mode & 0o777 == 0o700


def _graph(*batches: int, seq: tuple[int, ...] | None = None):
    seq = seq or (4,) * len(batches)
    return infer_graph([Sample((torch.zeros(b, s),)) for b, s in zip(batches, seq)], ["x"])


def test_warmup_covers_samples_and_corners() -> None:
    graph = _graph(1, 8, seq=(3, 5))
    labels = [label for label, _ in warmup_cases(graph, [Sample((torch.zeros(1, 3),)), Sample((torch.zeros(8, 5),))])]
    assert labels == ["sample 0", "sample 1", "batch=1, d0=3", "batch=8, d0=5", "batch=1, d0=5", "batch=8, d0=3"]
    shapes = [tuple(s.args[0].shape) for _, s in warmup_cases(graph, [Sample((torch.zeros(1, 3),))])]
    assert shapes[1:] == [(1, 3), (8, 5), (1, 5), (8, 3)]


def test_unseen_sizes_skip_warmed_and_specialized_sizes() -> None:
    graph = _graph(1, 8)
    assert unseen_sizes(graph, [{"batch": 1}, {"batch": 8}, {"batch": 4}]) == {"batch": 5}
    assert unseen_sizes(_graph(1, 2), [{"batch": 1}, {"batch": 2}]) is None


def test_trace_sizes_avoid_zero_and_one() -> None:
    assert trace_sizes(_graph(1, 1, 8)) == {"batch": 2}
    assert trace_sizes(_graph(4, 4, 8)) == {"batch": 4}


def test_a_thread_count_from_a_file_is_capped_at_the_machines_cores(monkeypatch) -> None:
    """``cpp.threads`` is an option a file may set; 2000 must not become 2000 threads."""
    from aitune.backend import machine_cores
    from aitune.testing import config_from_json
    from aitune_backend_inductor import jit

    config = config_from_json(
        {"backend": "torch_inductor_jit", "options": {"cpp.threads": 2000, "max_autotune": False}}, from_file=True
    )
    seen = {}

    class Stop(Exception):
        pass

    def compile_(module, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(jit.torch, "compile", compile_)
    graph = infer_graph([Sample((torch.randn(2, 4),))], ["x"])
    with pytest.raises(Stop):
        jit.TorchInductorJitBackend(config)._compile(torch.nn.Linear(4, 4), graph, torch.device("cpu"), [])
    assert seen["options"] == {"cpp.threads": machine_cores(), "max_autotune": False, **PRIVATE_OPTIONS}


def test_a_graph_pinned_to_one_batch_size_is_exported_without_a_dim():
    """What ``MaxThroughputStrategy(static_shapes=True)`` relies on (``builds_static``): the batch range
    ``b..b`` gives torch.export no ``Dim``, so AOTInductor compiles for that shape alone."""
    import attrs

    from aitune.graph import BATCH, DimRange
    from aitune_backend_inductor.aot import TorchInductorAotBackend
    from aitune_backend_inductor.shapes import export_dynamic_shapes

    assert TorchInductorAotBackend.builds_static
    graph = infer_graph([Sample((torch.randn(b, 4),)) for b in (2, 6)], ["x"])
    assert export_dynamic_shapes(graph)[1] == {BATCH: [2, 6]}
    pinned = attrs.evolve(graph, dims={**graph.dims, BATCH: DimRange(6, 6, 6)})
    assert export_dynamic_shapes(pinned) == (None, {})
