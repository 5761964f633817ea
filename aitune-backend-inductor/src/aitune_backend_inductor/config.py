"""Configurations of the inductor backends: frozen attrs classes that round-trip through JSON."""

from __future__ import annotations

import json
from typing import Any

import attrs

from aitune.plugin import BackendConfig, ConfigError, machine_cores

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""The ``torch.compile`` modes every supported torch (>= 2.6) knows."""


def _check_mode(instance: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and value not in MODES:
        raise ConfigError(f"{attribute.name}={value!r} is not a torch.compile mode; use None or one of {list(MODES)}")


FILE_SAFE_OPTIONS = frozenset(
    {
        "aggressive_fusion",
        "benchmark_kernel",
        "comprehensive_padding",
        "conv_1x1_as_mm",
        "coordinate_descent_tuning",
        "cpp.simdlen",
        "cpp.threads",
        "cpp.weight_prepack",
        "cpp_wrapper",
        "epilogue_fusion",
        "freezing",
        "keep_output_stride",
        "layout_optimization",
        "max_autotune",
        "max_autotune_gemm",
        "max_autotune_pointwise",
        "max_fusion_size",
        "pattern_matcher",
        "permute_fusion",
        "shape_padding",
        "split_reductions",
        "triton.cudagraph_trees",
        "triton.cudagraphs",
        "triton.max_tiles",
        "triton.unique_kernel_names",
        "unroll_reductions_threshold",
    }
)
"""Inductor options a file (an artifact, a cache entry) may set: switches and sizes of its passes,
with a bool or number value. The rest can name a compiler or a command (``cpp.cxx``), load a
library, or break results on purpose (``*_TESTING_ONLY``), so only the user's own code sets them."""


THREAD_OPTIONS = ("cpp.threads",)
"""Options that set a thread count: capped at the cores the process may use, wherever they come from."""


def capped_options(options: dict[str, Any] | None) -> dict[str, Any] | None:
    """``options`` as Inductor gets them: a thread count above the machine's cores is lowered to it
    (a file may set ``cpp.threads``, and 2000 would start 2000 threads)."""
    if not options:
        return None
    cores = machine_cores()
    return {
        k: min(v, cores) if k in THREAD_OPTIONS and isinstance(v, int) and not isinstance(v, bool) else v
        for k, v in options.items()
    }


def _file_refusals(options: dict[str, Any] | None) -> list[str]:
    refused = []
    for key, value in (options or {}).items():
        if key not in FILE_SAFE_OPTIONS:
            refused.append(f"options[{key!r}] (not an Inductor option a file may set)")
        elif isinstance(value, str) or not isinstance(value, (bool, int, float)):
            refused.append(f"options[{key!r}]={value!r} (a file may give it a bool or a number only)")
    return refused


def _check_options(instance: Any, attribute: attrs.Attribute, value: dict[str, Any] | None) -> None:
    """Inductor options live in the manifest, so they must be a JSON object with string keys."""
    if value is None:
        return
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{attribute.name} must be a dict with string keys (Inductor option names), got {value!r}")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{attribute.name} must hold JSON values only (it is saved in the artifact): {exc}") from None


@attrs.frozen(kw_only=True)
class TorchInductorJitBackendConfig(BackendConfig):
    """Settings of TorchInductorJitBackend (the arguments of ``torch.compile``)."""

    mode: str | None = attrs.field(default=None, validator=_check_mode)
    """A ``torch.compile`` mode; ``reduce-overhead`` and ``max-autotune`` use CUDA graphs on CUDA."""
    options: dict[str, Any] | None = attrs.field(default=None, validator=_check_options, hash=False)
    """Inductor options (``{"epilogue_fusion": True}``); torch.compile takes these or a mode, not both."""
    dynamic: bool | None = None
    """None: the graph's dynamic axes are compiled dynamic, the rest static. True: every axis dynamic.
    False: static kernels only, which cannot cover a graph with dynamic axes."""
    fullgraph: bool = False
    """True: a graph break fails the build instead of splitting the module into several graphs."""

    def untrusted_settings(self) -> list[str]:
        return _file_refusals(self.options)

    def __attrs_post_init__(self) -> None:
        if self.mode is not None and self.options:
            raise ConfigError(
                f"set either mode ({self.mode!r}) or options, not both: torch.compile accepts one "
                "(a mode is a preset of options; put the options you want in options)"
            )


@attrs.frozen(kw_only=True)
class TorchInductorAotBackendConfig(BackendConfig):
    """Settings of TorchInductorAotBackend (torch.export, then AOTInductor)."""

    options: dict[str, Any] | None = attrs.field(default=None, validator=_check_options, hash=False)
    """Inductor options for ``aoti_compile_and_package`` (``inductor_configs``)."""
    strict: bool = False
    """Export with TorchDynamo tracing (``torch.export.export(strict=True)``) instead of the default."""

    def untrusted_settings(self) -> list[str]:
        return _file_refusals(self.options)
