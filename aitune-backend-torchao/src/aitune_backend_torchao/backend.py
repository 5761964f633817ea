"""TorchAOBackend: quantize a copy of the module with torchao, optionally compile it.

Quantization buys speed with accuracy, so the backend states how much accuracy it may spend
(``tolerance``) and reports how much it did spend (``build_info["accuracy"]``), measured against
the eager module on the recorded samples.

Compiled (``compile=True``, the default), it compiles with Inductor at build, at load, and at run
time for a shape not seen before: every one of those runs with Inductor pointed at aitune's
private cache (``inductor_cache``, then an ``InductorCacheSwitch`` around each call), never at
Inductor's default folder in ``/tmp``, which another account can make first and fill.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from aitune.plugin import (
    DEFAULT_TOLERANCES,
    INDUCTOR_MODULES,
    Backend,
    BuildContext,
    BuildError,
    GraphSpec,
    InductorCacheSwitch,
    LoadContext,
    Sample,
    SerializationError,
    Tolerance,
    inductor_cache,
    inductor_options,
    resize,
    tree,
)

from . import quiet, weights
from .config import TorchAOBackendConfig, from_json_form
from .presets import CUSTOM_TOLERANCE, PRESETS, for_torchao_class

PAYLOAD_FORMAT = 1

TORCHAO_INDUCTOR_OPTIONS = {
    "coordinate_descent_tuning": True,
    "coordinate_descent_check_all_directions": True,
    "force_fuse_int_mm_with_mul": True,
}
"""torchao's recommended Inductor settings, as options of this backend's compiles (torchao would set
them globally); those this torch does not know are left out."""


class TorchAOBackend(Backend):
    """TorchAO quantization (int8 weight-only, int8 dynamic, int4, float8), optionally compiled."""

    name = "torchao"
    config_class = TorchAOBackendConfig
    warm_imports = ("torchao", "torchao.quantization", *INDUCTOR_MODULES)  # quantizes, then torch.compile
    config: TorchAOBackendConfig

    def __init__(self, config: TorchAOBackendConfig | None = None) -> None:
        super().__init__(config)
        self._runner: Any = None
        self._model: torch.nn.Module | None = None
        self._cache: InductorCacheSwitch | None = None

    # -- what the engine asks before building ----------------------------------------------

    def tolerance(self, dtype: torch.dtype) -> Tolerance | None:
        """The preset's bound (or the user's), never tighter than the dtype's own default."""
        if not dtype.is_floating_point:
            return None
        own = self.config.tolerance or self._preset_tolerance()
        if self.config.tolerance is not None:
            return own
        base = DEFAULT_TOLERANCES.get(str(dtype).removeprefix("torch."), DEFAULT_TOLERANCES["float32"])
        return Tolerance(
            atol=max(own.atol, base.atol),
            rtol=max(own.rtol, base.rtol),
            min_cosine=min(own.min_cosine, base.min_cosine),
        )

    def unsupported_reason(self, graph: GraphSpec, device: torch.device) -> str | None:
        preset = PRESETS.get(self.config.quantization) if isinstance(self.config.quantization, str) else None
        if preset is not None:
            return preset.unsupported_reason(device)
        return None

    # -- build and run ---------------------------------------------------------------------

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        with inductor_cache(context.cache_dir) as folder:  # torchao's import and torch.compile read it too
            self._cache = InductorCacheSwitch(folder)
            self._build(module, context)

    def _build(self, module: torch.nn.Module, context: BuildContext) -> None:
        model = self._quantized(module)
        self._runner = self._compiled(model)
        try:
            outputs = self._warm_up(_warm_up_samples(context.graph, context.samples))
        except Exception as exc:
            raise BuildError(
                f"the module quantized with {self.config.quantization_name} fails to run"
                f"{' under torch.compile' if self.config.compile else ''}: {type(exc).__name__}: {exc}; "
                "exclude the failing submodules with filter_fn or choose another preset"
            ) from exc
        with torch.no_grad():
            expected = [module(*s.args, **s.kwargs) for s in context.samples]
        self.build_info = {
            "quantization": self.config.quantization_name,
            "quantized_tensors": len(weights.quantized_tensors(model)),
            "compiled": self.config.compile,
            "accuracy": _accuracy(expected, outputs[: len(expected)]),
            "tolerance": _tolerance_info(self.tolerance(torch.float32)),
        }
        self._model = model

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        if self._runner is None or self._cache is None:
            raise BuildError("TorchAOBackend.infer was called before build() or load()")
        with self._cache, torch.no_grad():  # a new shape compiles again, into aitune's cache
            return self._runner(*args, **kwargs)

    # -- save and load ---------------------------------------------------------------------

    def save(self, directory: Path) -> dict[str, Any]:
        """Write the quantized weights as safetensors, or nothing when they must be re-quantized at load."""
        reason = self.config.unsaveable_reason()
        if reason:
            raise SerializationError(f"cannot save the torchao backend: {reason}")
        if self._model is None:
            raise SerializationError("cannot save the torchao backend before build()")
        import torchao

        stored = weights.save(self._model, directory)
        return {
            "format": PAYLOAD_FORMAT,
            "torchao": torchao.__version__,
            "weights": "safetensors" if stored else "requantize",
            "quantized": sorted(weights.quantized_tensors(self._model)),
        }

    def load(self, module: torch.nn.Module, directory: Path, context: LoadContext) -> None:
        with inductor_cache(context.cache_dir) as folder:  # compile=True compiles here, at ait.load
            self._cache = InductorCacheSwitch(folder)
            self._load(module, directory, context)

    def _load(self, module: torch.nn.Module, directory: Path, context: LoadContext) -> None:
        meta = context.metadata
        if meta.get("format") != PAYLOAD_FORMAT:
            raise SerializationError(
                f"torchao payload format {meta.get('format')!r} is not {PAYLOAD_FORMAT}; "
                "re-tune the model with this version of aitune-backend-torchao"
            )
        if meta.get("weights") == "safetensors":
            model = copy.deepcopy(module)
            weights.load(model, directory, context.device, expected=meta.get("quantized", []))
        else:
            model = self._quantized(module)
        self._model = model
        self._runner = self._compiled(model)
        if self.config.compile:
            self._warm_up(_warm_up_samples(context.graph, [context.graph.example("opt")]))
        self.build_info = {
            "quantization": self.config.quantization_name,
            "weights": meta.get("weights"),
            "compiled": self.config.compile,
        }

    # -- steps -----------------------------------------------------------------------------

    def _preset_tolerance(self) -> Tolerance:
        preset = PRESETS.get(self.config.quantization) if isinstance(self.config.quantization, str) else None
        if preset is None:
            preset = for_torchao_class(self.config.quantization_name)
        return preset.tolerance if preset is not None else CUSTOM_TOLERANCE

    def _torchao_config(self) -> Any:
        q = self.config.quantization
        if isinstance(q, str):
            return PRESETS[q].make()
        if isinstance(q, dict):
            return from_json_form(q)  # aitune's closed reader: torchao's config_from_dict calls what a file names
        return q

    def _quantized(self, module: torch.nn.Module) -> torch.nn.Module:
        """A quantized deep copy of ``module``; the original is left as it was."""
        quiet.import_torchao()
        from torchao.quantization import quantize_

        model = copy.deepcopy(module)
        try:
            quantize_(model, self._torchao_config(), filter_fn=self.config.filter_fn)
        except (ImportError, AssertionError, NotImplementedError, RuntimeError, ValueError) as exc:
            raise BuildError(
                f"torchao could not apply {self.config.quantization_name} to this module: {type(exc).__name__}: {exc}"
            ) from exc
        if not weights.quantized_tensors(model):
            raise BuildError(
                f"{self.config.quantization_name} quantized no weight of this module: no submodule matched "
                "filter_fn (torchao quantizes nn.Linear by default), or torchao skipped every match (for "
                "example a layer width the group size does not divide); widen the filter or drop this candidate"
            )
        for p in model.parameters():
            p.requires_grad_(False)
        return model

    def _compiled(self, model: torch.nn.Module) -> Any:
        if not self.config.compile:
            return model
        import torch._inductor.config as inductor

        known = inductor.get_config_copy()
        ours = {k: v for k, v in TORCHAO_INDUCTOR_OPTIONS.items() if k in known}
        return torch.compile(model, options=inductor_options(ours, self.config.compile_mode))

    def _warm_up(self, samples: list[Sample]) -> list[Any]:
        """Run every sample once, so compilation happens here and not at the user's first call."""
        with torch.no_grad():
            return [self._runner(*s.args, **s.kwargs) for s in samples]


def _warm_up_samples(graph: GraphSpec, samples: list[Sample]) -> list[Sample]:
    """The samples, then the first one at the min and max of every dynamic axis (as validation runs)."""
    out = list(samples)
    if samples and graph.dims:
        for which in ("min", "max"):
            out.append(resize(graph, samples[0], {n: getattr(r, which) for n, r in graph.dims.items()}))
    return out


def _accuracy(expected: list[Any], actual: list[Any]) -> dict[str, float]:
    """Worst relative error (against max|eager|), absolute error and cosine over every floating output."""
    worst = {"max_abs_error": 0.0, "max_rel_error": 0.0, "min_cosine": 1.0}
    for exp, act in zip(expected, actual):
        for e, a in zip(tree.flatten(exp)[0], tree.flatten(act)[0]):
            if not e.dtype.is_floating_point or e.numel() == 0:
                continue
            e, a = e.detach().double().flatten(), a.detach().double().flatten().to(e.device)
            abs_err = float((a - e).abs().max())
            scale = float(e.abs().max())
            worst["max_abs_error"] = max(worst["max_abs_error"], abs_err)
            worst["max_rel_error"] = max(worst["max_rel_error"], abs_err / scale if scale > 0 else abs_err)
            norms = float(e.norm() * a.norm())
            if norms > 0:
                worst["min_cosine"] = min(worst["min_cosine"], float(torch.dot(e, a)) / norms)
    return worst


def _tolerance_info(tol: Tolerance | None) -> dict[str, float] | None:
    return None if tol is None else {"atol": tol.atol, "rtol": tol.rtol, "min_cosine": tol.min_cosine}
