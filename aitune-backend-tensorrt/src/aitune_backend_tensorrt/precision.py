"""Lower precision before the build: ModelOpt's ONNX AutoCast (fp16/bf16) or quantization (int8/fp8).

Both rewrite the ONNX model so that a strongly typed TensorRT network takes every layer's
precision from it. Both measure value ranges on data; they get the recorded samples, all of them,
one calibration batch per recorded call, never random inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from aitune.plugin import BackendUnavailableError, BuildError, GraphSpec, Sample

from .config import ModelOptQuantizationConfig, ONNXAutoCastConfig

_LARGE_MODEL_BYTES = 1_800_000_000
"""Above this a protobuf gets close to its 2 GiB limit, so weights go to an external data file."""


def calibration_feeds(graph: GraphSpec, samples: Sequence[Sample], input_names: Sequence[str]) -> list[dict[str, Any]]:
    """One ``{onnx input name: numpy array}`` per recorded sample, in the ONNX model's input order."""
    feeds = []
    for sample in samples:
        tensors = graph.flatten(sample.args, sample.kwargs)
        feeds.append({name: _numpy(name, t) for name, t in zip(input_names, tensors)})
    return feeds


def _numpy(name: str, t: torch.Tensor) -> Any:
    if t.dtype == torch.bfloat16:
        raise BuildError(
            f"input {name!r} is bfloat16, which numpy-based ONNX calibration cannot feed; record float32 "
            "samples for calibration or drop quantization_config"
        )
    return t.detach().cpu().numpy()


def _modelopt(module: str) -> Any:
    """ModelOpt's ``module``, once the installed release is known to have the calls made here."""
    import importlib

    from .compat import installed_modelopt, modelopt_reason

    too_old = modelopt_reason(installed_modelopt())  # before the import: older releases fail inside it
    if too_old:
        raise BackendUnavailableError(f"quantization_config cannot run: {too_old}")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"quantization_config needs NVIDIA ModelOpt's ONNX tools ({module}), which cannot be imported: {exc}; "
            "install them: pip install 'aitune-backend-tensorrt[runtime]'"
        ) from exc


def _save(model: Any, path: Path) -> Path:
    import onnx

    if model.ByteSize() > _LARGE_MODEL_BYTES:
        onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    else:
        onnx.save(model, str(path))
    return path


def providers_for(wanted: Sequence[str], device_index: int | None) -> list[str]:
    """ModelOpt's provider names with a bare ``cuda`` made the device being built for (``cuda:1``)."""
    index = device_index or 0
    return [f"cuda:{index}" if name == "cuda" else name for name in wanted]


def reference_providers(device_index: int | None) -> list[str]:
    """Where AutoCast runs its fp32 reference: the GPU being built for when ONNX Runtime has CUDA, else the CPU."""
    try:
        import onnxruntime as ort

        cuda = device_index is not None and "CUDAExecutionProvider" in ort.get_available_providers()
    except ImportError:
        cuda = False
    return [f"cuda:{device_index}", "cpu"] if cuda else ["cpu"]


def autocast(
    onnx_path: Path,
    config: ONNXAutoCastConfig,
    feeds: Sequence[dict[str, Any]],
    workdir: Path,
    output: Path | None = None,
    device_index: int | None = None,
) -> Path:
    """The model with nodes cast to ``config.low_precision_type`` where the recorded ranges allow it.

    Calibration data goes to ``workdir``, the model to ``output`` (default: ``workdir``). The fp32
    reference AutoCast compares against runs on the GPU being built for (``device_index``) when ONNX
    Runtime can, not on ModelOpt's default, the CPU.
    """
    import numpy as np

    convert = _modelopt("modelopt.onnx.autocast").convert_to_mixed_precision
    calibration = None
    if config.calibrate_on_samples and feeds:
        folder = workdir / "autocast-calibration"
        folder.mkdir(parents=True, exist_ok=True)
        for i, feed in enumerate(feeds):  # a folder of .npz files is AutoCast's multi-batch input
            np.savez(folder / f"sample-{i:05d}.npz", **feed)
        calibration = str(folder)
    try:
        model = convert(
            onnx_path=str(onnx_path),
            low_precision_type=config.low_precision_type,
            nodes_to_exclude=list(config.nodes_to_exclude) or None,
            op_types_to_exclude=list(config.op_types_to_exclude) or None,
            data_max=config.data_max,
            init_max=config.init_max,
            keep_io_types=config.keep_io_types,
            calibration_data=calibration,
            providers=reference_providers(device_index),
        )
    except Exception as exc:
        raise BuildError(
            f"ModelOpt AutoCast to {config.low_precision_type} failed: {type(exc).__name__}: {exc}"
        ) from exc
    return _save(model, (output or workdir) / f"model.{config.low_precision_type}.onnx")


def quantize(
    onnx_path: Path,
    config: ModelOptQuantizationConfig,
    feeds: Sequence[dict[str, Any]],
    workdir: Path,
    external_data: bool = False,
    output: Path | None = None,
    device_index: int | None = None,
) -> tuple[Path, int]:
    """The model with Q/DQ nodes calibrated on every feed; also how many distinct feeds calibration
    read (ModelOpt rewinds the reader between passes: a feed read twice counts once).

    The model goes to ``output`` (default: ``workdir``); calibration runs on the GPU being built for.
    """
    quantization = _modelopt("modelopt.onnx.quantization")
    from onnxruntime.quantization.calibrate import CalibrationDataReader

    class SampleReader(CalibrationDataReader):
        """Hands ModelOpt the recorded samples one call at a time (it rewinds between passes)."""

        def __init__(self) -> None:
            self.seen: set[int] = set()
            self._it = iter(enumerate(feeds))

        @property
        def served(self) -> int:
            return len(self.seen)

        def get_next(self) -> dict[str, Any] | None:
            index, feed = next(self._it, (None, None))
            if index is not None:
                self.seen.add(index)
            return feed

        def get_first(self) -> dict[str, Any]:
            return feeds[0]

        def rewind(self) -> None:
            self._it = iter(enumerate(feeds))

    if not feeds:
        raise BuildError("ModelOpt quantization needs recorded samples to calibrate on; none were given")
    reader = SampleReader()
    out = (output or workdir) / f"model.{config.mode}.onnx"
    try:
        quantization.quantize(
            onnx_path=str(onnx_path),
            quantize_mode=config.mode,
            calibration_data_reader=reader,
            calibration_method=config.calibration,
            calibration_eps=providers_for(config.calibration_providers, device_index),
            high_precision_dtype=config.high_precision_dtype,
            op_types_to_exclude=list(config.op_types_to_exclude) or None,
            nodes_to_exclude=list(config.nodes_to_exclude) or None,
            use_external_data_format=external_data,
            output_path=str(out),
            log_level="WARNING",
        )
    except Exception as exc:
        raise BuildError(f"ModelOpt {config.mode} quantization failed: {type(exc).__name__}: {exc}") from exc
    if not out.exists():
        raise BuildError(f"ModelOpt {config.mode} quantization wrote no model at {out}")
    return out, reader.served
