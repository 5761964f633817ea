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

from aitune.plugin import BuildError

from . import compat
from .compat import Machine
from .config import BUILDER_PRECISION_FLAGS, TensorRTBackendConfig
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
    strongly_typed = config.strongly_typed or only_strongly_typed(trt)
    network = builder.create_network(network_flags(trt, strongly_typed))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT's ONNX parser rejected the exported model: {errors}")

    builder_config = builder.create_builder_config()
    configure_builder(trt, builder_config, config)
    dynamic = _add_profiles(builder, builder_config, network, profiles, input_names)
    cache_state = _use_timing_cache(builder_config, timing_cache)

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


def only_strongly_typed(trt: Any) -> bool:
    """TensorRT 11 builds strongly typed networks only: it has no weak-typing precision flags left."""
    return not hasattr(trt.BuilderFlag, "FP16")


def network_flags(trt: Any, strongly_typed: bool) -> int:
    """``create_network`` flags: STRONGLY_TYPED where the release still has it (on 11 it is the only mode)."""
    member = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 1 << int(member) if strongly_typed and member is not None else 0


def _builder_flag(trt: Any, name: str, why: str) -> Any:
    flag = getattr(trt.BuilderFlag, name, None)
    if flag is None:
        raise BuildError(f"TensorRT {trt.__version__} has no builder flag {name} ({why}); leave it out of the config")
    return flag


def configure_builder(trt: Any, builder_config: Any, config: TensorRTBackendConfig) -> None:
    """Apply the config's builder settings, refusing by name what this TensorRT release cannot do."""
    weak = sorted(BUILDER_PRECISION_FLAGS & set(config.builder_flags))
    if weak and only_strongly_typed(trt):
        raise BuildError(
            f"TensorRT {trt.__version__} removed the weak-typing precision flags {weak}: every network is strongly "
            "typed, so precision comes from the ONNX model. Drop builder_flags and use "
            "quantization_config=ONNXAutoCastConfig(...) or ModelOptQuantizationConfig(...), or install TensorRT 10 "
            f"(pip install 'tensorrt-cu{compat.torch_cuda_major() or 13}>=10,<11')"
        )
    if config.workspace_size is not None:
        builder_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, config.workspace_size)
    builder_config.builder_optimization_level = config.optimization_level
    # each layer's formats stay in the plan, so the build can check the precision it got (layers.py)
    builder_config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    if not config.tf32:
        builder_config.clear_flag(_builder_flag(trt, "TF32", "tf32=False clears it"))
    for name in config.builder_flags:
        builder_config.set_flag(_builder_flag(trt, name, "builder_flags asks for it"))
    if config.version_compatible:
        builder_config.set_flag(_builder_flag(trt, "VERSION_COMPATIBLE", "version_compatible=True sets it"))
    if config.hardware_compatible:
        level = getattr(getattr(trt, "HardwareCompatibilityLevel", None), "AMPERE_PLUS", None)
        if level is None:
            raise BuildError(
                f"TensorRT {trt.__version__} has no AMPERE_PLUS hardware compatibility level; set hardware_compatible=False"
            )
        builder_config.hardware_compatibility_level = level


def _use_timing_cache(builder_config: Any, path: Path | None) -> str:
    """Give the builder the timing cache at ``path``; a cache this build cannot use is replaced by a fresh one."""
    if path is None:
        return "off"
    previous = path.read_bytes() if path.is_file() else b""
    state = "reused" if previous else "new"
    cache = builder_config.create_timing_cache(previous)
    if cache is None or not builder_config.set_timing_cache(cache, ignore_mismatch=False):
        if not previous:
            raise BuildError("TensorRT refused a new, empty timing cache; set use_timing_cache=False")
        cache = builder_config.create_timing_cache(b"")  # written by another TensorRT or GPU, or damaged
        if cache is None or not builder_config.set_timing_cache(cache, ignore_mismatch=False):
            raise BuildError("TensorRT refused a fresh timing cache; set use_timing_cache=False")
        state = f"replaced (TensorRT could not use {path.name})"
    return state


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
        if builder_config.add_optimization_profile(trt_profile) < 0:
            raise BuildError(
                f"TensorRT refused the optimisation profile {profile.to_json(input_names)} "
                "(see the TensorRT log above); each axis needs min <= opt <= max within the model's limits"
            )
    return True
