"""Check a torch.export ``.pt2`` archive before ``torch.export.load`` reads it, so nothing in it is unpickled.

The archive's program is JSON and plain weights are raw bytes, but ``torch.export.load`` also
accepts entries that it reads with Python's pickle: tensor subclasses, opaque Python objects,
legacy whole-file weights, example inputs (a ``torch.load`` that falls back to full unpickling)
and AOTInductor libraries that it loads as native code. This module refuses every such entry,
reading the archive as a zip and its configs as JSON, executing nothing. Two kinds of TensorRT
engine constant are let through, after a check that they can only rebuild an engine:

* ``custom_obj_*``: a TorchBind object (Torch-TensorRT's C++ ``tensorrt.Engine``), read by
  TorchScript's own unpickler, which resolves no Python globals, only registered TorchScript
  classes, and rebuilds the engine from its list of strings.
* ``opaque_obj_*`` (Torch-TensorRT releases that store engines as Python objects): a pickle whose
  opcodes are checked statically (``pickletools``, nothing run) to call exactly one function,
  Torch-TensorRT's engine rebuilder, on plain strings and numbers.
"""

from __future__ import annotations

import io
import json
import pickletools
import zipfile
from typing import Any

import torch

from aitune.plugin import SerializationError

ALLOWED_GLOBALS = frozenset({("torch_tensorrt.dynamo.runtime._TRTEngine", "_reconstruct_trt_engine")})
"""The only callables an opaque engine pickle may name."""

_TOP_LEVEL = frozenset({"archive_format", "archive_version", "byteorder"})
_FOLDERS = (".data/", "models/", "data/weights/", "data/constants/", "data/sample_inputs/", "extra/")

_DATA_OPCODES = frozenset(
    {
        "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT",
        "GET", "BINGET", "LONG_BINGET", "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2",
        "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE",
        "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
        "BYTEARRAY8", "EMPTY_LIST", "APPEND", "APPENDS", "LIST", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2",
        "TUPLE3", "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS",
    }
)  # fmt: skip
"""Opcodes that only build strings, numbers, bytes and containers: no call, no attribute, no import."""
_STRING_OPCODES = frozenset({"UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "STRING", "BINSTRING", "SHORT_BINSTRING"})  # fmt: skip


def check_engine_pickle(data: bytes) -> None:
    """Refuse a pickle unless it only calls an allowed engine rebuilder on plain data.

    Every opcode is read by ``pickletools`` (which parses and runs nothing). Globals are resolved
    statically: ``GLOBAL`` carries its name inline, ``STACK_GLOBAL`` must directly follow the two
    string pushes it consumes. Calls (``REDUCE``) are allowed because the only callables that can be
    on the stack are allowed globals; ``BUILD``, ``INST``, ``OBJ``, ``NEWOBJ`` and extension codes are not.
    """
    recent: list[Any] = []  # values of the latest string pushes, for STACK_GLOBAL
    named = 0
    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "FRAME"):
                continue
            if name == "GLOBAL":
                module, _, attr = str(arg).partition(" ")
                _require_allowed(module, attr)
                named += 1
            elif name == "STACK_GLOBAL":
                if len(recent) < 2 or not all(isinstance(v, str) for v in recent[-2:]):
                    raise SerializationError("an engine pickle names a global it computes at run time; refused")
                _require_allowed(recent[-2], recent[-1])
                named += 1
            elif name == "REDUCE":
                if not named:
                    raise SerializationError("an engine pickle calls something that is not a named global; refused")
            elif name not in _DATA_OPCODES:
                raise SerializationError(f"an engine pickle uses the opcode {name}, which can run code; refused")
            recent = [*recent[-1:], arg] if name in _STRING_OPCODES else []
    except ValueError as exc:  # pickletools' word for a malformed stream
        raise SerializationError(f"an engine pickle is malformed: {exc}") from exc


def _require_allowed(module: str, attr: str) -> None:
    if (module, attr) not in ALLOWED_GLOBALS:
        raise SerializationError(
            f"the archive asks to unpickle {module}.{attr}, which is not a TensorRT engine; refused "
            "(aitune never unpickles arbitrary objects: rebuild the artifact from the model)"
        )


def check_pt2_archive(data: bytes) -> None:
    """Raise :class:`SerializationError` unless ``torch.export.load`` can read ``data`` without unpickling.

    Refused: entries outside the folders of a torch.export program (AOTInductor or ExecuTorch
    payloads, legacy layouts), pickled tensors, opaque objects other than TensorRT engines, and
    example inputs that ``torch.load(weights_only=True)`` cannot read.
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise SerializationError(f"the exported program is not a zip archive: {exc}") from exc
    entries = _entries(archive)
    if entries.get("archive_format", b"").decode(errors="replace").strip() != "pt2":
        raise SerializationError("the exported program is not a torch.export .pt2 archive (no archive_format 'pt2')")
    for path, content in entries.items():
        if path.startswith(("data/weights/", "data/constants/")) and path.endswith("_config.json"):
            _check_payload_config(path, content, entries)
        elif path.startswith(("data/weights/", "data/constants/")) and path.endswith(".pt"):
            raise SerializationError(f"{path} holds weights in the legacy pickled layout; refused")
        elif path.startswith("data/sample_inputs/") and content:
            _check_sample_inputs(path, content)


def _entries(archive: zipfile.ZipFile) -> dict[str, bytes]:
    roots = {info.filename.split("/", 1)[0] for info in archive.infolist()}
    if len(roots) != 1:
        raise SerializationError(f"the exported program has entries outside one root folder: {sorted(roots)}")
    entries: dict[str, bytes] = {}
    for info in archive.infolist():
        if info.is_dir():
            continue
        path = info.filename.split("/", 1)[1] if "/" in info.filename else ""
        if path not in _TOP_LEVEL and not path.startswith(_FOLDERS):
            raise SerializationError(
                f"the exported program holds {info.filename!r}, which torch.export.load could read as pickle "
                "or native code; refused"
            )
        entries[path] = archive.read(info)
    return entries


def _check_payload_config(path: str, content: bytes, entries: dict[str, bytes]) -> None:
    try:
        config = json.loads(content)["config"]
    except (ValueError, KeyError, TypeError) as exc:
        raise SerializationError(f"{path} is not a payload config: {exc}") from exc
    folder = path.rsplit("/", 1)[0] + "/"
    for fqn, meta in config.items():
        if not isinstance(meta, dict) or not meta.get("use_pickle"):
            continue
        file_name = str(meta.get("path_name", ""))
        if folder == "data/constants/" and file_name.startswith("custom_obj_"):
            continue  # TorchBind object: TorchScript's unpickler, no Python globals
        if folder == "data/constants/" and file_name.startswith("opaque_obj_"):
            check_engine_pickle(entries.get(folder + file_name, b""))
            continue
        raise SerializationError(f"{fqn!r} in {path} is stored as a Python pickle ({file_name}); refused")


def _check_sample_inputs(path: str, content: bytes) -> None:
    try:
        torch.load(io.BytesIO(content), weights_only=True)
    except Exception as exc:  # torch.export.load would retry this with full unpickling
        raise SerializationError(
            f"{path} cannot be read with torch.load(weights_only=True) ({type(exc).__name__}), and "
            "torch.export.load would unpickle it; refused"
        ) from exc


def load_exported_program(data: bytes) -> torch.export.ExportedProgram:
    """``torch.export.load`` of archive bytes that :func:`check_pt2_archive` accepted.

    The checked bytes are the bytes loaded (no second read of a file that could have changed).
    """
    check_pt2_archive(data)
    return torch.export.load(io.BytesIO(data))
