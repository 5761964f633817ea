"""The TensorRT API calls a build makes, per TensorRT generation, checked against a recording stand-in.

The stand-in module has the names of TensorRT's Python API a build touches and records every call,
so these tests see which flags reach the builder on TensorRT 10 and 11, and what happens when a
builder call reports failure; no test here loads TensorRT or needs a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from aitune.errors import BuildError, ConfigError
from aitune_backend_tensorrt.config import TensorRTBackendConfig
from aitune_backend_tensorrt.engine import build_plan, configure_builder, network_flags, only_strongly_typed
from aitune_backend_tensorrt.profiles import ShapeProfile

_COMMON = ("TF32", "SPARSE_WEIGHTS", "DIRECT_IO", "REFIT", "VERSION_COMPATIBLE")
_WEAK = ("FP16", "BF16", "INT8", "FP8")


class BuilderConfig:
    def __init__(self, accept_cache=(True,)) -> None:
        self.set, self.cleared, self.profiles, self.caches = [], [], [], []
        self._accept = list(accept_cache)

    def set_memory_pool_limit(self, pool, size):
        self.workspace = size

    def set_flag(self, flag):
        self.set.append(flag)

    def clear_flag(self, flag):
        self.cleared.append(flag)

    def create_timing_cache(self, data):
        return SimpleNamespace(data=data, serialize=lambda: b"timings")

    def set_timing_cache(self, cache, ignore_mismatch):
        self.caches.append(cache.data)
        return self._accept.pop(0) if self._accept else True

    def get_timing_cache(self):
        return self.create_timing_cache(b"")

    def add_optimization_profile(self, profile):
        self.profiles.append(profile)
        return self.accept_profile

    accept_profile = 0


def fake_tensorrt(version: str, builder_config: BuilderConfig, input_shape=(-1, 4)) -> SimpleNamespace:
    """A ``tensorrt`` module of ``version``: 10.x keeps the weak-typing flags, 11.x does not."""
    weak = version.startswith("10.")
    flags = {n: n for n in _COMMON + (_WEAK if weak else ())}
    network = SimpleNamespace(
        num_inputs=1, num_layers=3, get_input=lambda i: SimpleNamespace(name="x", shape=input_shape), flags=None
    )

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            network.flags = flags
            return network

        def create_builder_config(self):
            return builder_config

        def create_optimization_profile(self):
            return SimpleNamespace(set_shape=lambda *a: None)

        def build_serialized_network(self, net, cfg):
            return b"plan"

    return SimpleNamespace(
        __version__=version,
        Logger=Logger,
        Builder=Builder,
        OnnxParser=lambda net, logger: SimpleNamespace(parse_from_file=lambda p: True, num_errors=0),
        NetworkDefinitionCreationFlag=SimpleNamespace(**({"STRONGLY_TYPED": 5} if weak else {})),
        BuilderFlag=SimpleNamespace(**flags),
        MemoryPoolType=SimpleNamespace(WORKSPACE="workspace"),
        ProfilingVerbosity=SimpleNamespace(DETAILED="detailed"),
        HardwareCompatibilityLevel=SimpleNamespace(AMPERE_PLUS="ampere+"),
        network=network,
    )


class Logger:
    WARNING = 0

    def __init__(self, level: int) -> None:
        self.level = level


PROFILE = ShapeProfile((((1, 4), (2, 4), (8, 4)),))


def _build(monkeypatch, tmp_path: Path, trt, config: TensorRTBackendConfig, cache: Path | None = None):
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"")
    return build_plan(onnx, [PROFILE], ["x"], config, cache)


def test_tensorrt_10_weak_typing_sets_the_precision_flags():
    cfg = BuilderConfig()
    trt = fake_tensorrt("10.9.0", cfg)
    configure_builder(trt, cfg, TensorRTBackendConfig(strongly_typed=False, builder_flags=("FP16",), tf32=False))
    assert cfg.set == ["FP16"] and cfg.cleared == ["TF32"]
    assert cfg.profiling_verbosity == "detailed"  # the build's precision check reads each layer's formats
    assert not only_strongly_typed(trt)
    assert network_flags(trt, strongly_typed=True) == 1 << 5 and network_flags(trt, strongly_typed=False) == 0


def test_tensorrt_11_refuses_precision_flags_by_name_instead_of_an_attribute_error():
    cfg = BuilderConfig()
    trt = fake_tensorrt("11.1.0", cfg)
    config = TensorRTBackendConfig(strongly_typed=False, builder_flags=("FP16", "SPARSE_WEIGHTS"))
    with pytest.raises(
        BuildError, match=r"TensorRT 11\.1\.0 removed the weak-typing precision flags \['FP16'\]"
    ) as info:
        configure_builder(trt, cfg, config)
    assert "ONNXAutoCastConfig" in str(info.value)
    assert cfg.set == []


def test_tensorrt_11_builds_strongly_typed_without_the_removed_creation_flag(monkeypatch, tmp_path):
    cfg = BuilderConfig()
    trt = fake_tensorrt("11.1.0", cfg)
    plan, info = _build(monkeypatch, tmp_path, trt, TensorRTBackendConfig(strongly_typed=False, use_timing_cache=False))
    assert plan == b"plan" and info["strongly_typed"] is True  # 11 has no weak typing: report what was built
    assert trt.network.flags == 0 and info["tensorrt_version"] == "11.1.0"
    assert len(cfg.profiles) == 1 and info["dynamic"]


def test_a_flag_missing_from_this_release_is_named(monkeypatch):
    cfg = BuilderConfig()
    trt = fake_tensorrt("10.9.0", cfg)
    del trt.BuilderFlag.TF32
    with pytest.raises(BuildError, match=r"TensorRT 10\.9\.0 has no builder flag TF32 \(tf32=False clears it\)"):
        configure_builder(trt, cfg, TensorRTBackendConfig(tf32=False))


def test_strip_plan_is_refused_because_nothing_refits():
    with pytest.raises(ConfigError, match="STRIP_PLAN .* does not refit"):
        TensorRTBackendConfig(builder_flags=("STRIP_PLAN",))


def test_a_refused_optimisation_profile_stops_the_build(monkeypatch, tmp_path):
    cfg = BuilderConfig()
    cfg.accept_profile = -1
    with pytest.raises(BuildError, match="TensorRT refused the optimisation profile"):
        _build(monkeypatch, tmp_path, fake_tensorrt("10.9.0", cfg), TensorRTBackendConfig(use_timing_cache=False))


def test_a_timing_cache_the_builder_refuses_is_replaced_and_reported(monkeypatch, tmp_path):
    cache = tmp_path / "cache.bin"
    cache.write_bytes(b"from another TensorRT")
    cfg = BuilderConfig(accept_cache=(False, True))
    _, info = _build(monkeypatch, tmp_path, fake_tensorrt("10.9.0", cfg), TensorRTBackendConfig(), cache)
    assert cfg.caches == [b"from another TensorRT", b""]
    assert info["timing_cache"].startswith("replaced")
    assert cache.read_bytes() == b"timings"

    cfg = BuilderConfig()
    _, info = _build(monkeypatch, tmp_path, fake_tensorrt("10.9.0", cfg), TensorRTBackendConfig(), cache)
    assert info["timing_cache"] == "reused" and cfg.caches == [b"timings"]


def test_a_timing_cache_refused_twice_stops_the_build(monkeypatch, tmp_path):
    cache = tmp_path / "cache.bin"
    cache.write_bytes(b"x")
    cfg = BuilderConfig(accept_cache=(False, False))
    with pytest.raises(BuildError, match="use_timing_cache=False"):
        _build(monkeypatch, tmp_path, fake_tensorrt("10.9.0", cfg), TensorRTBackendConfig(), cache)
