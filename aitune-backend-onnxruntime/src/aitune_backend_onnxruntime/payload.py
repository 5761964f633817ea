"""Save and load: an exported graph's files and metadata in a payload folder, and back.

The payload holds the ONNX graph ONNX Runtime opens, its external-data files and, where saved,
ONNX Runtime's optimized graph; the metadata lists them with the input and output names, the
output structure and the refit plan. A payload is read as untrusted data: every file it names must
be one it carries, inside its folder, and no graph may keep tensor data anywhere else.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aitune.plugin import MODEL_FILE, SerializationError, payload_file

from .export import BatchNormFold, ExportedModel, PlanEntry

OPTIMIZED_FILE = "model.optimized.onnx"


def save(exported: ExportedModel, directory: Path) -> dict[str, Any]:
    """Copy ``exported``'s files into ``directory``; the metadata :func:`read` takes back."""
    files = list(dict.fromkeys(exported.files + exported.optimized))
    for name in files:
        shutil.copy2(exported.folder / name, Path(directory) / name)
    return {
        **exported.export_info,
        "model": exported.model,
        "files": files,
        "optimized_model": OPTIMIZED_FILE if exported.optimized else None,
        "input_names": list(exported.input_names),
        "output_names": list(exported.output_names),
        "output_structure": exported.output_structure,
        "refit_plan": {name: plan_entry_json(entry) for name, entry in exported.refit_plan.items()},
    }


def read(meta: Mapping[str, Any], directory: Path, output_structure: Any) -> ExportedModel:
    """The payload in ``directory`` as ``meta`` describes it, once every file it lists is there and
    the graphs it names are among them (``output_structure``: the graph's own, if it has one)."""
    try:
        files = [str(f) for f in meta["files"]]
        input_names, output_names = tuple(meta["input_names"]), tuple(meta["output_names"])
    except (KeyError, TypeError) as exc:
        raise SerializationError(f"onnxruntime payload metadata lacks {exc}; re-tune and save again") from exc
    for name in files:
        if not payload_file(directory, name).is_file():
            raise SerializationError(
                f"onnxruntime payload misses the file {name!r} it lists; the artifact is incomplete"
            )
    for key in ("model", "optimized_model"):  # the graph ONNX Runtime opens is one of those files
        if meta.get(key) is not None and meta[key] not in files:
            raise SerializationError(
                f"onnxruntime payload names {key} {meta[key]!r}, which is not one of its files; the artifact "
                "is corrupt or hostile"
            )
    return ExportedModel(
        folder=Path(directory),
        files=[f for f in files if f != meta.get("optimized_model")],
        input_names=input_names,
        output_names=output_names,
        output_structure=output_structure or meta["output_structure"],
        export_info={k: meta.get(k) for k in ("exporter", "opset", "provider", "fallback_reason")},
        model=str(meta.get("model", MODEL_FILE)),
        optimized=files if meta.get("optimized_model") else [],  # a superset of what it references
        refit_plan=plan_from_metadata(meta.get("refit_plan")),
    )


def copied_to(exported: ExportedModel, folder: Path) -> ExportedModel:
    """``exported`` with its files hard-linked (or copied) into ``folder``."""
    for name in dict.fromkeys(exported.files + exported.optimized):
        _link_or_copy(payload_file(exported.folder, name), payload_file(folder, name))
    exported.folder = folder
    return exported


def plan_entry_json(entry: PlanEntry) -> Any:
    """A refit plan entry as saved: ``[key, transposed]``, or a fold's fields."""
    if isinstance(entry, BatchNormFold):
        return entry.to_json()
    return [entry[0], entry[1]]


def plan_from_metadata(data: Any) -> dict[str, PlanEntry]:
    """A refit plan from a payload's metadata (untrusted): names, flags and numbers only, anything
    else ignored (the refit's check against eager still judges what the plan gives)."""
    if not isinstance(data, dict):
        return {}
    plan: dict[str, PlanEntry] = {}
    for name, entry in data.items():
        if not isinstance(name, str):
            continue
        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], bool):
            plan[name] = (entry[0], entry[1])
        elif isinstance(entry, dict) and entry.get("fold") == "batch_norm":
            part, layer, norm = entry.get("part"), entry.get("layer"), entry.get("norm")
            eps, axis = entry.get("eps"), entry.get("axis", 0)
            if (
                part in ("weight", "bias")
                and (layer is None or isinstance(layer, str))
                and (layer is not None or part == "bias")
                and isinstance(norm, str)
                and isinstance(eps, float)
                and 0 < eps < 1
                and axis in (0, 1)
                and not isinstance(axis, bool)
            ):
                plan[name] = BatchNormFold(part, layer, norm, eps, axis)
    return plan


def external_data_outside(model: Path, files: Sequence[str]) -> str | None:
    """The first external-data location of ``model`` that is not one of the payload's ``files``, or None.

    An ONNX graph may keep tensors in other files, named inside the graph: from an artifact, such a
    name could point anywhere on the machine, so every one must be a file the payload carries.
    """
    import onnx
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    proto = onnx.load(str(model), load_external_data=False)
    for tensor in _get_all_tensors(proto):
        if not uses_external_data(tensor):
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        if location not in files:
            return location
    return None


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
