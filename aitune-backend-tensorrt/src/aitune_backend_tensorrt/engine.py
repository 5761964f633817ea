"""ONNX to a serialized TensorRT plan with the TensorRT Python API.

The network is parsed from the ONNX file (external weights next to it are found by path), given
one optimisation profile per :class:`ShapeProfile`, and built with a timing cache read from and
written back to aitune's cache dir, so kernels timed once on this GPU are not timed again.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aitune.errors import BuildError

from .compat import Machine
from .config import TensorRTBackendConfig
from .profiles import ShapeProfile


def timing_cache_path(cache_dir: Path, machine: Machine) -> Path:
    """Where kernel timings for this TensorRT release and GPU live: one file per (version, compute capability)."""
    version = machine.tensorrt_version or "unknown"
    cc = "".join(str(c) for c in machine.compute_capability) if machine.compute_capability else "unknown"
    return cache_dir / "tensorrt" / f"timing-cache-trt{version}-sm{cc}.bin"


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_plan(
    onnx_path: Path,
    profiles: Sequence[ShapeProfile],
    input_names: Sequence[str],
    config: TensorRTBackendConfig,
    timing_cache: Path | None,
) -> tuple[bytes, dict[str, Any]]:
    """Build the plan; return it with facts for the build report."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    strongly_typed = config.strongly_typed and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
    if strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT's ONNX parser rejected the exported model: {errors}")

    builder_config = builder.create_builder_config()
    if config.workspace_size is not None:
        builder_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, config.workspace_size)
    builder_config.builder_optimization_level = config.optimization_level
    if not config.tf32:
        builder_config.clear_flag(trt.BuilderFlag.TF32)
    for name in config.builder_flags:
        builder_config.set_flag(getattr(trt.BuilderFlag, name))
    if config.version_compatible:
        builder_config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    if config.hardware_compatible:
        builder_config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS

    dynamic = _add_profiles(builder, builder_config, network, profiles, input_names)

    cache_state = "off"
    if timing_cache is not None:
        previous = timing_cache.read_bytes() if timing_cache.is_file() else b""
        cache = builder_config.create_timing_cache(previous)
        builder_config.set_timing_cache(cache, ignore_mismatch=False)
        cache_state = "reused" if previous else "new"

    start = time.perf_counter()
    plan = builder.build_serialized_network(network, builder_config)
    seconds = time.perf_counter() - start
    if plan is None:
        raise BuildError(
            "TensorRT could not build an engine (see the TensorRT log above); try a larger workspace_size, "
            "another optimization_level, or check that every layer is supported"
        )
    if timing_cache is not None:
        _write_atomic(timing_cache, bytes(builder_config.get_timing_cache().serialize()))
    info = {
        "tensorrt_version": trt.__version__,
        "strongly_typed": strongly_typed,
        "layers": network.num_layers,
        "dynamic": dynamic,
        "profiles": len(profiles) if dynamic else 1,
        "engine_build_seconds": round(seconds, 3),
        "timing_cache": cache_state,
    }
    return bytes(plan), info


def _add_profiles(
    builder: Any, builder_config: Any, network: Any, profiles: Sequence[ShapeProfile], input_names: Sequence[str]
) -> bool:
    """Add one TensorRT profile per :class:`ShapeProfile`; False when the network is static and needs none."""
    by_name = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
    if sorted(by_name) != sorted(input_names):
        raise BuildError(f"the ONNX model's inputs {sorted(by_name)} are not the exported inputs {sorted(input_names)}")
    for profile in profiles:
        for name, (lo, _, hi) in zip(input_names, profile.shapes):
            for axis, size in enumerate(tuple(by_name[name].shape)):
                if size >= 0 and not lo[axis] == hi[axis] == size:
                    raise BuildError(
                        f"the ONNX export fixed axis {axis} of {name!r} to {size}, but the profile needs "
                        f"{lo[axis]}..{hi[axis]}; the exporter specialised a dynamic axis (see its warnings)"
                    )
    dynamic = {n for n in input_names if any(d < 0 for d in tuple(by_name[n].shape))}
    if not dynamic:
        return False
    for profile in profiles:
        trt_profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in zip(input_names, profile.shapes):
            if name in dynamic:
                trt_profile.set_shape(name, lo, opt, hi)
        builder_config.add_optimization_profile(trt_profile)
    return True
