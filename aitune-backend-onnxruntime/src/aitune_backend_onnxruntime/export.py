"""The export: the module's graph as ONNX files ONNX Runtime opens, quantized when the config asks.

:func:`export_graph` exports once per graph and shares the files between the variants that run the
same export (:mod:`.exports`); :class:`ExportedModel` is what the runner opens and the payload
saves: the files, the input and output names, and which module weight each initializer holds.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from aitune.plugin import (
    MODEL_FILE,
    BuildContext,
    BuildError,
    GraphSpec,
    NotApplicableError,
    ONNXExport,
    export_onnx,
    model_files,
)

from .config import ONNXExecutionProvider, ONNXRuntimeBackendConfig
from .exports import shared_export

INT8_FILE = "model.int8.onnx"

NUMPY_DTYPES = frozenset(
    {torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool}
)
"""Weight dtypes numpy holds as they are (bfloat16 has no numpy twin: such a graph is not refitted)."""


@attrs.frozen
class BatchNormFold:
    """An initializer the exporter computed from a layer and the batch norm after it (both exporters
    fold ``Conv``/``Linear`` -> ``BatchNorm`` in eval mode): the layer's weight scaled per channel by
    ``gamma / sqrt(var + eps)`` (``part="weight"``), or its bias shifted by the norm
    (``part="bias"``; ``layer`` None where the layer has no bias)."""

    part: str
    layer: str | None
    """The state-dict key of the layer's weight (``part="weight"``) or bias."""
    norm: str
    """The batch norm's module path (its ``running_var`` is ``<norm>.running_var``)."""
    eps: float
    axis: int = 0
    """The weight's output-channel axis (1 for a transposed convolution)."""

    def value(self, weights: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """The folded tensor from ``weights``, or None when one it needs is missing."""
        var, mean = weights.get(f"{self.norm}.running_var"), weights.get(f"{self.norm}.running_mean")
        layer = weights.get(self.layer) if self.layer is not None else None
        if var is None or mean is None or (self.layer is not None and layer is None):
            return None
        gamma, beta = weights.get(f"{self.norm}.weight"), weights.get(f"{self.norm}.bias")
        dtype = (layer if layer is not None else var).dtype  # computed in fp32, stored as the graph's
        var, mean = var.detach().float(), mean.detach().float()
        scale = torch.rsqrt(var + self.eps) * (gamma.detach().float() if gamma is not None else 1.0)
        if self.part == "weight":
            assert layer is not None
            shape = [1] * layer.dim()
            shape[self.axis] = -1
            return (layer.detach().float() * scale.reshape(shape)).to(dtype)
        shift = beta.detach().float() if beta is not None else torch.zeros_like(mean)
        base = layer.detach().float() if layer is not None else torch.zeros_like(mean)
        return ((base - mean) * scale + shift).to(dtype)

    def to_json(self) -> dict[str, Any]:
        return {"fold": "batch_norm", **attrs.asdict(self)}


PlanEntry = tuple[str, bool] | BatchNormFold
"""How to compute one initializer from the module's weights: (key, transposed), or a fold."""


@attrs.define
class ExportedModel:
    """An exported graph in ``folder``: what the runner opens and the payload saves and loads."""

    folder: Path
    files: list[str]
    """The graph ONNX Runtime opens and its external-data files."""
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    output_structure: Any
    """How the flat outputs nest (a :mod:`aitune.tree` structure)."""
    export_info: dict[str, Any]
    """The exporter, opset, provider and fallback reason, saved with the payload."""
    model: str = MODEL_FILE
    """The graph ONNX Runtime opens: the export's, or its int8 version."""
    optimized: list[str] = attrs.Factory(list)
    """ONNX Runtime's optimized graph and its files, when saved (a superset of what it references)."""
    optimized_without: list[str] = attrs.Factory(list)
    """The graph rewrites the session that wrote the optimized graph ran without (a load uses that
    graph only where its session would run without the same ones)."""
    refit_plan: dict[str, PlanEntry] = attrs.Factory(dict)
    """Per initializer of the graph, how it follows from the module's weights (:func:`refit_plan`)."""

    @classmethod
    def of(cls, export: ONNXExport, folder: Path, graph: GraphSpec, provider: ONNXExecutionProvider) -> ExportedModel:
        return cls(
            folder=folder,
            files=list(export.files),
            input_names=export.input_names,
            output_names=export.output_names,
            output_structure=graph.output_structure or export.output_structure,
            export_info={
                "exporter": export.exporter,
                "opset": export.opset,
                "provider": provider.value,
                "fallback_reason": export.fallback_reason,
            },
        )


def export_graph(
    module: torch.nn.Module, context: BuildContext, config: ONNXRuntimeBackendConfig, owner: object, folder: Path
) -> tuple[ONNXExport, bool]:
    """``module`` exported to ``folder`` with the config's attention implementation; True when the
    files were copied from another variant's identical export (``owner``'s folder holds them)."""
    graph = context.graph
    dims = tuple(sorted((n, r.min, r.max) for n, r in graph.dims.items()))
    attention = effective_attention(module, config.attention)  # read before the block changes it
    key = (graph.key, dims, str(context.device), config.export, attention)
    with attention_implementation(module, config.attention):
        return shared_export(
            module,
            key,
            context.samples,
            owner,
            folder,
            lambda: export_onnx(module, graph, context.samples[0], folder, config.export, samples=context.samples),
        )


def quantize(exported: ExportedModel, context: BuildContext, quantization: str) -> float:
    """The exported graph quantized to int8 (dynamic, or static QDQ calibrated on the recorded
    samples); ``exported`` then opens the int8 graph. Returns the seconds it took."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    source, target = exported.folder / MODEL_FILE, exported.folder / INT8_FILE
    external = len(exported.files) > 1
    start = time.perf_counter()
    try:
        if quantization == "dynamic_int8":
            quantize_dynamic(source, target, weight_type=QuantType.QInt8, use_external_data_format=external)
        else:
            feeds = [
                {
                    name: t.detach().cpu().numpy()
                    for name, t in zip(exported.input_names, context.graph.flatten(s.args, s.kwargs))
                }
                for s in context.samples
            ]

            class Samples(CalibrationDataReader):
                def __init__(self) -> None:
                    self.left = iter(feeds)

                def get_next(self) -> dict[str, Any] | None:
                    return next(self.left, None)

            quantize_static(
                source,
                target,
                Samples(),
                quant_format=QuantFormat.QDQ,
                activation_type=QuantType.QInt8,
                weight_type=QuantType.QInt8,
                use_external_data_format=external,
            )
    except Exception as exc:
        raise BuildError(
            f"ONNX Runtime could not quantize the exported graph ({quantization}): {type(exc).__name__}: {exc}"
        ) from exc
    exported.model, exported.files = INT8_FILE, list(model_files(target))
    return time.perf_counter() - start


def plan_value(entry: PlanEntry, weights: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The value ``entry``'s initializer takes under ``weights``; None when a weight is missing."""
    if isinstance(entry, BatchNormFold):
        return entry.value(weights)
    key, transposed = entry
    tensor = weights.get(key)
    if tensor is None:
        return None
    return tensor.detach().t() if transposed else tensor.detach()


def batch_norm_eps(module: torch.nn.Module) -> dict[str, float]:
    """The ``eps`` of every batch norm in ``module``, by module path: a fold needs it, the state dict lacks it."""
    return {
        name: float(m.eps)
        for name, m in module.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    }


def refit_plan(
    model: Path, weights: Mapping[str, torch.Tensor], norms: Mapping[str, float] | None = None
) -> dict[str, PlanEntry]:
    """Which module weight each initializer of ``model`` holds: by name (``module.<name>``) or by
    equal values, as is or transposed (a ``Linear`` weight the exporter stored for ``MatMul``), or
    a layer folded with the batch norm after it (``norms``: each norm's eps). Every entry is checked
    against the initializer's values, so an exporter's fold kept under the layer's name is not taken
    for the layer. An initializer equal to several weights of different names maps to none of them:
    refitting it would be a guess."""
    import onnx

    hosts = {
        key: t.detach().cpu() for key, t in weights.items() if t.dtype in NUMPY_DTYPES and t.device.type != "meta"
    }  # once per weight, however many initializers it is compared with
    by_shape: dict[tuple[int, ...], list[tuple[str, torch.Tensor, bool]]] = collections.defaultdict(list)
    for key, host in hosts.items():
        by_shape[tuple(host.shape)].append((key, host, False))
        if host.dim() == 2:
            by_shape[tuple(host.t().shape)].append((key, host.t(), True))
    proto = onnx.load(str(model), load_external_data=False)
    plan: dict[str, PlanEntry] = {}
    unmapped: dict[str, torch.Tensor] = {}
    for init in proto.graph.initializer:
        key = init.name.removeprefix("module.")
        # a scalar maps by its name only: by value, every constant 1.0 would be some weight's twin
        candidates = list(by_shape.get(tuple(init.dims), [])) if init.dims else []
        if key in hosts and tuple(hosts[key].shape) == tuple(init.dims):
            candidates.insert(0, (key, hosts[key], False))
        if not candidates and not norms:
            continue
        value = _initializer_value(init, model.parent)
        if value is None:
            continue
        named = candidates[:1] if candidates and candidates[0][0] == key else []
        if named and torch.equal(named[0][1], value):
            plan[init.name] = (key, False)
            continue
        found = {(k, t) for k, host, t in candidates if host.shape == value.shape and torch.equal(host, value)}
        if len({k for k, _ in found}) == 1:
            plan[init.name] = next(iter(found))
        elif not found and value.is_floating_point() and init.dims:
            unmapped[init.name] = value
    if norms and unmapped:
        plan.update(_batch_norm_folds(unmapped, hosts, norms))
    return plan


def _initializer_value(init: Any, folder: Path) -> torch.Tensor | None:
    """An initializer's values (read from its external-data file where it keeps them there)."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    if uses_external_data(init):
        init = copy.copy(init)  # loading fills the tensor: the graph's own stays a reference
        try:
            load_external_data_for_tensor(init, str(folder))
        except Exception:
            return None
        init.data_location = onnx.TensorProto.DEFAULT
        del init.external_data[:]
    try:
        array = numpy_helper.to_array(init)
    except Exception:
        return None
    if array.dtype.kind not in "fiub":
        return None
    return torch.from_numpy(array.copy())


def _batch_norm_folds(
    unmapped: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor], norms: Mapping[str, float]
) -> dict[str, BatchNormFold]:
    """The unmapped initializers that are a layer folded with a batch norm: weights first (the
    layer nearest before the norm in the module's order wins), then the biases of those pairs."""
    order = {key: i for i, key in enumerate(weights)}
    layers = [k for k, t in weights.items() if k.endswith(".weight") and t.dim() >= 2 and t.is_floating_point()]
    found: dict[str, BatchNormFold] = {}
    pairs: list[tuple[str, str, float]] = []
    for name, value in unmapped.items():
        if value.dim() < 2:
            continue
        matches = []
        for norm, eps in norms.items():
            var = weights.get(f"{norm}.running_var")
            if var is None:
                continue
            for layer in layers:
                t = weights[layer]
                for axis in (0, 1):
                    if t.shape != value.shape or t.shape[axis] != var.numel():
                        continue
                    fold = BatchNormFold("weight", layer, norm, eps, axis)
                    folded = fold.value(weights)
                    if folded is not None and _close(folded, value):
                        distance = order.get(f"{norm}.running_var", 0) - order[layer]
                        matches.append((distance < 0, abs(distance), fold))
        if matches:
            fold = min(matches, key=lambda m: (m[0], m[1]))[2]
            found[name] = fold
            pairs.append((fold.layer.removesuffix(".weight") + ".bias", fold.norm, fold.eps))  # type: ignore[union-attr]
    for name, value in unmapped.items():
        if value.dim() != 1:
            continue
        for bias, norm, eps in pairs:
            fold = BatchNormFold("bias", bias if bias in weights else None, norm, eps)
            folded = fold.value(weights)
            if folded is not None and folded.shape == value.shape and _close(folded, value):
                found[name] = fold
                break
    return found


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float32 rounding of the fold's few operations (the exporter computes it its own way)."""
    a, b = a.float(), b.float()
    return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6 * (float(b.abs().max()) if b.numel() else 0.0)))


def write_refit_copy(exported: ExportedModel, values: Mapping[str, Any], folder: Path) -> tuple[Path, list[str]]:
    """A copy of the exported graph in ``folder`` with ``values`` (numpy arrays, by initializer
    name) in place of its initializers; the graph file and its files list.

    ONNX Runtime folds constants (a transposed weight, a batch norm into its convolution) from the
    initializers in the file while it optimizes, and ignores ``SessionOptions.add_initializer`` for
    those, so new weights go into the file itself. The layout stays the export's: a tensor kept in
    an external-data file is overwritten in a copy of that file at its own offset (same dtype and
    shape, same bytes), the others are written into the graph; files with nothing new are linked."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import uses_external_data

    folder.mkdir(parents=True, exist_ok=True)
    source = exported.folder / exported.model
    proto = onnx.load(str(source), load_external_data=False)
    patches: dict[str, list[tuple[int, bytes]]] = collections.defaultdict(list)
    left = dict(values)
    for init in proto.graph.initializer:
        array = left.pop(init.name, None)
        if array is None:
            continue
        new = numpy_helper.from_array(array, init.name)
        if new.data_type != init.data_type or list(new.dims) != list(init.dims):
            raise BuildError(f"refit: initializer {init.name!r} is {init.data_type}{list(init.dims)}, the new value "
                             f"{new.data_type}{list(new.dims)}")  # fmt: skip
        if uses_external_data(init):
            info = {e.key: e.value for e in init.external_data}
            data = new.raw_data
            if int(info.get("length", len(data))) != len(data):
                raise BuildError(
                    f"refit: initializer {init.name!r} has {info.get('length')} bytes on file, not {len(data)}"
                )
            patches[info["location"]].append((int(info.get("offset", 0)), data))
        else:
            init.CopyFrom(new)
    if left:
        raise BuildError(f"refit: the graph has no initializer {sorted(left)[0]!r}")
    for name in exported.files:
        if name == exported.model:
            continue
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        if name not in patches:
            _link_or_copy(exported.folder / name, target)
            continue
        shutil.copyfile(exported.folder / name, target)
        with open(target, "r+b") as f:
            for offset, data in patches[name]:
                f.seek(offset)
                f.write(data)
    onnx.save_model(proto, str(folder / exported.model))
    return folder / exported.model, list(exported.files)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _attention_configs(module: torch.nn.Module) -> list[Any]:
    """The transformers configs in ``module`` that name an attention implementation."""
    configs = (getattr(m, "config", None) for m in module.modules())
    return [c for c in configs if c is not None and hasattr(c, "_attn_implementation")]


def effective_attention(module: torch.nn.Module, chosen: str | None) -> str | None:
    """``chosen``, or None when every attention config of ``module`` already uses it: the export is
    then the plain variant's, and is shared with it."""
    configs = _attention_configs(module)
    if chosen is not None and configs and all(c._attn_implementation == chosen for c in configs):
        return None
    return chosen


@contextlib.contextmanager
def attention_implementation(module: torch.nn.Module, chosen: str | None) -> Iterator[None]:
    """``module``'s transformers configs set to the attention implementation ``chosen`` while the block
    runs, then restored; a module with no such config cannot take that variant (NotApplicableError: the
    report lists it as not applicable, not as a failure)."""
    if chosen is None:
        yield
        return
    configs = {id(c): c for c in _attention_configs(module)}
    if not configs:
        raise NotApplicableError(
            f"the {chosen} attention variant applies to transformers models only; this one has no attention config"
        )
    before = {key: config._attn_implementation for key, config in configs.items()}
    try:
        for config in configs.values():
            config._attn_implementation = chosen
        yield
    finally:
        for key, config in configs.items():
            config._attn_implementation = before[key]
