"""The export: the module's graph as ONNX files ONNX Runtime opens, quantized when the config asks.

:func:`export_graph` exports once per graph and shares the files between the variants that run the
same export (:mod:`.exports`); :class:`ExportedModel` is what the runner opens and the payload
saves: the files, the input and output names, and which module weight each initializer holds.
"""

from __future__ import annotations

import collections
import contextlib
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
    refit_plan: dict[str, tuple[str, bool]] = attrs.Factory(dict)
    """Per initializer of the graph, the module weight it holds and whether transposed."""

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


def refit_plan(model: Path, weights: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, bool]]:
    """Which module weight each initializer of ``model`` holds: by name (``module.<name>``), else by
    equal values, as is or transposed (a ``Linear`` weight the exporter stored for ``MatMul``). An
    initializer equal to several weights of different names maps to none of them: refitting it
    would be a guess."""
    import onnx
    from onnx import numpy_helper

    by_shape: dict[tuple[int, ...], list[tuple[str, torch.Tensor, bool]]] = collections.defaultdict(list)
    for key, tensor in weights.items():
        if tensor.dtype in NUMPY_DTYPES and tensor.device.type != "meta":
            host = tensor.detach().cpu()  # once per weight, however many initializers it is compared with
            by_shape[tuple(host.shape)].append((key, host, False))
            if host.dim() == 2:
                by_shape[tuple(host.t().shape)].append((key, host.t(), True))
    plan: dict[str, tuple[str, bool]] = {}
    for init in onnx.load(str(model), load_external_data=False).graph.initializer:
        key = init.name.removeprefix("module.")
        if key in weights and tuple(weights[key].shape) == tuple(init.dims):
            plan[init.name] = (key, False)
            continue
        candidates = by_shape.get(tuple(init.dims))
        if not candidates or init.data_location == onnx.TensorProto.EXTERNAL:
            continue  # an external-data tensor is not read here: only its name can map it
        value = torch.from_numpy(numpy_helper.to_array(init).copy())
        found = {(k, t) for k, host, t in candidates if torch.equal(host, value)}
        if len({k for k, _ in found}) == 1:
            plan[init.name] = next(iter(found))
    return plan


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
