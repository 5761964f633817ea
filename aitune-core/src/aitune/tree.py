"""Nested inputs and outputs as flat tensor lists plus a JSON-able structure.

A module call is ``(args, kwargs)`` with tensors nested in containers, next to plain values
(ints, strings, None, enum members...). Backends such as ONNX or TensorRT see only a flat list of
tensors; the structure says how to put them back, in the very types the module used: a tuned
module returns a ``NamedTuple``, a dataclass or a ``transformers`` ``ModelOutput`` where eager did.
The structure is plain JSON so it can live in a manifest; a type is named by its import path
(``module:QualName``) and rebuilt by importing it, never by unpickling.

Structure nodes::

    {"kind": "tensor"}                                    one tensor leaf
    {"kind": "const", "value": 3}                         a JSON scalar
    {"kind": "enum", "type": "pkg.mod:Color", "name": "RED"}
    {"kind": "tuple" | "list", "items": [...]}
    {"kind": "dict", "keys": ["a", "b"], "items": [...]}
    {"kind": "namedtuple" | "dataclass" | "mapping", "type": "pkg.mod:Out", "keys": [...], "items": [...]}
    {"kind": "pytree", "type": "pkg.mod:Node", "context": <JSON>, "items": [...]}

``mapping`` is a dict subclass (``OrderedDict``, ``ModelOutput``); ``pytree`` is any other type
registered with ``torch.utils._pytree`` whose context is JSON.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import importlib
import json
from typing import Any

import torch
import torch.utils._pytree as pytree

from .errors import InputError, UnsupportedValueError

_SCALARS = (bool, int, float, str, type(None))
_TYPED = ("namedtuple", "dataclass", "mapping")


def flatten(obj: Any, path: str = "") -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Split ``obj`` into its tensor leaves (depth-first order) and its structure.

    Raises :class:`UnsupportedValueError` naming the path of a value no backend can take.
    """
    leaves: list[torch.Tensor] = []
    return leaves, _flatten(obj, leaves, path)


def _flatten(obj: Any, leaves: list[torch.Tensor], path: str) -> dict[str, Any]:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return {"kind": "tensor"}
    cls = type(obj)
    if isinstance(obj, enum.Enum):
        return {"kind": "enum", "type": type_path(cls, path), "name": obj.name}
    if isinstance(obj, _SCALARS):
        return {"kind": "const", "value": obj}
    if cls in (tuple, list):
        return {"kind": cls.__name__, "items": [_flatten(v, leaves, f"{path}.{i}") for i, v in enumerate(obj)]}
    if cls is dict:
        keys = list(obj)
        if not all(isinstance(k, str) for k in keys):
            raise UnsupportedValueError(f"dict at {path or 'input'} has non-string keys {keys!r}; use string keys")
        return {"kind": "dict", "keys": keys, "items": [_flatten(obj[k], leaves, f"{path}.{k}") for k in keys]}
    if isinstance(obj, tuple) and hasattr(cls, "_fields"):
        return _typed("namedtuple", cls, list(cls._fields), list(obj), leaves, path)
    if isinstance(obj, dict) and (dataclasses.is_dataclass(cls) or cls is collections.OrderedDict):
        keys = list(obj)
        if not all(isinstance(k, str) for k in keys):
            raise UnsupportedValueError(f"{cls.__name__} at {path or 'input'} has non-string keys {keys!r}")
        return _typed("mapping", cls, keys, [obj[k] for k in keys], leaves, path)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = dataclasses.fields(obj)
        if any(not f.init for f in fields):
            raise UnsupportedValueError(
                f"the dataclass {cls.__qualname__} at {path or 'input'} has fields outside __init__, so it cannot "
                "be rebuilt from its fields"
            )
        names = [f.name for f in fields]
        return _typed("dataclass", cls, names, [getattr(obj, n) for n in names], leaves, path)
    if cls in pytree.SUPPORTED_NODES:
        return _pytree_node(obj, leaves, path)
    raise UnsupportedValueError(
        f"unsupported value of type {cls.__name__} at {path or 'input'}: aitune hands backends tensors in tuples, "
        "lists, dicts, NamedTuples, dataclasses, ModelOutputs and types torch.utils._pytree knows, next to JSON "
        "scalars (bool, int, float, str, None) and enum members"
    )


def _typed(kind: str, cls: type, keys: list[str], values: list[Any], leaves: list[torch.Tensor], path: str) -> Any:
    items = [_flatten(v, leaves, f"{path}.{k}") for k, v in zip(keys, values)]
    return {"kind": kind, "type": type_path(cls, path), "keys": keys, "items": items}


def _pytree_node(obj: Any, leaves: list[torch.Tensor], path: str) -> dict[str, Any]:
    cls = type(obj)
    children, context = pytree.SUPPORTED_NODES[cls].flatten_fn(obj)
    serial = pytree.SUPPORTED_SERIALIZED_TYPES.get(cls)
    dumpable = serial.to_dumpable_context(context) if serial and serial.to_dumpable_context else context
    try:
        ok = json.loads(json.dumps(dumpable)) == dumpable
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise UnsupportedValueError(
            f"{cls.__name__} at {path or 'input'} is known to torch.utils._pytree, but its context is not JSON, "
            "so it cannot be described in an artifact"
        )
    items = [_flatten(v, leaves, f"{path}.{i}") for i, v in enumerate(children)]
    return {"kind": "pytree", "type": type_path(cls, path), "context": dumpable, "items": items}


def type_path(cls: type, path: str = "") -> str:
    """``module:QualName`` of ``cls``, checked to import back to ``cls`` (a local class does not)."""
    name = f"{cls.__module__}:{cls.__qualname__}"
    try:
        found = resolve(name)
    except InputError:
        found = None
    if found is not cls:
        raise UnsupportedValueError(
            f"the type {cls.__qualname__} at {path or 'input'} cannot be imported back by its name {name!r} "
            "(defined inside a function, or shadowed), so aitune cannot rebuild it: define it at module level"
        )
    return name


@functools.lru_cache(maxsize=512)
def resolve(name: str) -> type:
    """The class a structure names, by importing its module (nothing is unpickled)."""
    module_name, _, qualname = name.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise InputError(
            f"the type {name!r} named in the output or input structure cannot be imported here "
            f"({type(exc).__name__}: {exc}); install the package that defines it"
        ) from None
    if not isinstance(obj, type):
        raise InputError(f"{name!r} names {type(obj).__name__}, not a class")
    return obj


def check_types(structure: dict[str, Any]) -> None:
    """Import every type ``structure`` names; raise :class:`InputError` for one that cannot be
    imported, or for a structure that is not one (it comes from a file)."""
    try:
        kind = structure["kind"]
        if kind in (*_TYPED, "enum", "pytree"):
            _checked(kind, str(structure["type"]))
        items = structure.get("items", [])
        if not isinstance(items, list):
            raise TypeError(f"items is a {type(items).__name__}")
    except (KeyError, TypeError, AttributeError) as exc:
        raise InputError(f"the structure is malformed ({type(exc).__name__}: {exc})") from None
    for node in items:
        check_types(node)


@functools.lru_cache(maxsize=512)
def _checked(kind: str, name: str) -> type:
    cls = resolve(name)
    ok = {
        "enum": issubclass(cls, enum.Enum),
        "namedtuple": issubclass(cls, tuple) and hasattr(cls, "_fields"),
        "mapping": issubclass(cls, dict),
        "dataclass": dataclasses.is_dataclass(cls),
        "pytree": cls in pytree.SUPPORTED_NODES,
    }.get(kind, False)
    if not ok:
        raise InputError(f"the structure names {name!r} as a {kind}, but it is not one; the structure is corrupt")
    return cls


def unflatten(structure: dict[str, Any], leaves: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> Any:
    """Rebuild the nested value that :func:`flatten` split, from ``leaves`` in the same order."""
    it = iter(leaves)
    return _unflatten(structure, it)


def _unflatten(node: dict[str, Any], it: Any) -> Any:
    kind = node["kind"]
    if kind == "tensor":
        return next(it)
    if kind == "const":
        return node["value"]
    if kind == "tuple":
        return tuple(_unflatten(n, it) for n in node["items"])
    if kind == "list":
        return [_unflatten(n, it) for n in node["items"]]
    if kind == "dict":
        return {k: _unflatten(n, it) for k, n in zip(node["keys"], node["items"])}
    if kind == "enum":
        return _checked(kind, node["type"])[node["name"]]  # type: ignore[index]
    if kind in _TYPED:
        cls = _checked(kind, node["type"])
        values = [_unflatten(n, it) for n in node["items"]]
        if kind == "namedtuple":
            return cls(*values)
        if kind == "mapping" and not dataclasses.is_dataclass(cls):
            return cls(zip(node["keys"], values))
        return cls(**dict(zip(node["keys"], values)))
    if kind == "pytree":
        cls = _checked(kind, node["type"])
        serial = pytree.SUPPORTED_SERIALIZED_TYPES.get(cls)
        context = node["context"]
        if serial and serial.from_dumpable_context:
            context = serial.from_dumpable_context(context)
        return pytree.SUPPORTED_NODES[cls].unflatten_fn([_unflatten(n, it) for n in node["items"]], context)
    raise InputError(f"unknown structure node kind {kind!r}")


def leaf_paths(structure: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of the tensor leaves, in flatten order (``args.0``, ``kwargs.mask``)."""
    out: list[str] = []
    _paths(structure, prefix, out)
    return out


def _paths(node: dict[str, Any], path: str, out: list[str]) -> None:
    kind = node["kind"]
    if kind == "tensor":
        out.append(path)
    elif "keys" in node:
        for k, n in zip(node["keys"], node["items"]):
            _paths(n, f"{path}.{k}" if path else k, out)
    elif "items" in node:
        for i, n in enumerate(node["items"]):
            _paths(n, f"{path}.{i}" if path else str(i), out)


def call_key(obj: Any, leaves: list[torch.Tensor]) -> Any:
    """A cheap hashable key of a call's structure; appends tensor leaves to ``leaves``.

    Tensors contribute dtype, rank and device type (not shape), so calls that differ only in the
    sizes of their axes share a key; constants contribute their value (objects: their identity).
    This is the per-call dispatch path: keep it allocation-light.
    """
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return (obj.dtype, obj.dim(), obj.device.type)
    if isinstance(obj, (tuple, list)):
        return (type(obj), tuple([call_key(v, leaves) for v in obj]))
    if isinstance(obj, dict):
        return (type(obj), tuple([(k, call_key(v, leaves)) for k, v in obj.items()]))
    if isinstance(obj, _SCALARS):
        return (type(obj), obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj), tuple([call_key(getattr(obj, f.name), leaves) for f in dataclasses.fields(obj)]))
    return (type(obj), id(obj))
