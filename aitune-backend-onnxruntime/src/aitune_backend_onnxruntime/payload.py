"""Save and load: an exported graph's files and metadata in a payload folder, and back.

The payload holds the ONNX graph ONNX Runtime opens, its external-data files and, where saved,
ONNX Runtime's optimized graph; the metadata lists them with the input and output names, the
output structure and the refit plan. A payload is read as untrusted data: every file it names must
be one it carries, inside its folder, and no graph may keep tensor data anywhere else.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
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
        "optimized_without": list(exported.optimized_without) if exported.optimized else None,
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
    name could point anywhere on the machine (or, as ONNX Runtime's ``*/_ORT_MEM_ADDR_/*``, at
    memory), so every one must be a file the payload carries. Read from the protobuf's wire format
    by :func:`external_locations`, without importing ``onnx`` (0.4 s of a cold load).
    """
    with open(model, "rb") as f:
        data = f.read()
    for location in external_locations(data):
        if location not in files:
            return location
    return None


# Where a TensorProto can sit in an ONNX ModelProto, by field number (onnx.proto): per message, the
# fields that hold messages which may hold tensors, and what they are.
_SCHEMA: dict[str, dict[int, str]] = {
    "model": {7: "graph", 20: "training", 25: "function"},
    "training": {1: "graph", 2: "graph"},  # TrainingInfoProto: initialization, algorithm
    "graph": {1: "node", 5: "tensor", 15: "sparse"},  # node, initializer, sparse_initializer
    "function": {7: "node", 11: "attribute"},  # node, attribute_proto (default attribute values)
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},  # SparseTensorProto: values, indices
}
_EXTERNAL_DATA, _DATA_LOCATION, _EXTERNAL = 13, 14, 1  # TensorProto.external_data, .data_location, EXTERNAL
MAX_NESTING = 100
"""Messages nested deeper than this (subgraphs within subgraphs) make the graph refused."""


class _Malformed(Exception):
    pass


def external_locations(data: bytes) -> list[str]:
    """Every ``location`` of every tensor of the serialized ONNX model ``data`` that keeps its data
    externally (``data_location`` EXTERNAL), wherever the tensor sits: initializers, sparse
    initializers, node attributes, subgraphs, functions, training info. A tensor marked external
    with no location gives ``""``; one with several ``location`` entries gives each (ONNX Runtime
    takes the last, onnx the first). Raises :class:`SerializationError` for bytes that are not a
    well-formed protobuf message."""
    out: list[str] = []
    try:
        _message(memoryview(data), "model", 0, out)
    except _Malformed as exc:
        raise SerializationError(
            f"the onnxruntime payload's graph is not a well-formed ONNX model ({exc}); the artifact is corrupt or hostile"
        ) from None
    return out


def _fields(buf: memoryview) -> Iterator[tuple[int, int, Any]]:
    """``(field number, wire type, value)`` of each field of one message: an int for a varint, a
    memoryview for a length-delimited field, None for a fixed-size one."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _Malformed("field number 0")
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield number, wire, value
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if size > end - pos:
                raise _Malformed("a field runs past its message")
            yield number, wire, buf[pos : pos + size]
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            if pos > end:
                raise _Malformed("a field runs past its message")
            yield number, wire, None
        else:  # groups (3, 4) are not used by ONNX, and 6, 7 do not exist
            raise _Malformed(f"wire type {wire}")


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise _Malformed("a truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _message(buf: memoryview, kind: str, depth: int, out: list[str]) -> None:
    if depth > MAX_NESTING:
        raise _Malformed(f"messages nested more than {MAX_NESTING} deep")
    if kind == "tensor":
        _tensor(buf, out)
        return
    children = _SCHEMA[kind]
    for number, wire, value in _fields(buf):
        child = children.get(number)
        if child is not None:
            if wire != 2:
                raise _Malformed(f"field {number} of a {kind} is not a message")
            _message(value, child, depth + 1, out)


def _tensor(buf: memoryview, out: list[str]) -> None:
    external = False
    locations: list[str] = []
    for number, wire, value in _fields(buf):
        if number == _DATA_LOCATION:
            if wire != 0:
                raise _Malformed("a tensor's data_location is not a varint")
            external = value == _EXTERNAL  # a field given twice: the last one counts
        elif number == _EXTERNAL_DATA:
            if wire != 2:
                raise _Malformed("a tensor's external_data is not a message")
            key = text = None
            for entry_number, entry_wire, entry_value in _fields(value):
                if entry_number in (1, 2):
                    if entry_wire != 2:
                        raise _Malformed("an external_data entry is not a string")
                    try:
                        decoded = bytes(entry_value).decode("utf-8")
                    except UnicodeDecodeError:
                        raise _Malformed("an external_data entry is not UTF-8") from None
                    key, text = (decoded, text) if entry_number == 1 else (key, decoded)
            if key == "location":
                locations.append(text or "")
    if external:
        out.extend(locations or [""])


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
