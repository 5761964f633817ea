"""Nested inputs and outputs as flat tensor lists plus a JSON-able structure.

A module call is ``(args, kwargs)`` with tensors nested in tuples, lists and dicts, next to plain
values (ints, strings, None...). Backends such as ONNX or TensorRT see only a flat list of tensors;
the structure says how to put them back. The structure is plain JSON so it can live in a manifest.

Structure nodes::

    {"kind": "tensor"}                                    one tensor leaf
    {"kind": "const", "value": 3}                         a JSON scalar
    {"kind": "tuple" | "list", "items": [...]}
    {"kind": "dict", "keys": ["a", "b"], "items": [...]}
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import InputError

_SCALARS = (bool, int, float, str, type(None))


def flatten(obj: Any, path: str = "") -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Split ``obj`` into its tensor leaves (depth-first order) and its structure."""
    leaves: list[torch.Tensor] = []
    return leaves, _flatten(obj, leaves, path)


def _flatten(obj: Any, leaves: list[torch.Tensor], path: str) -> dict[str, Any]:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return {"kind": "tensor"}
    if isinstance(obj, _SCALARS):
        return {"kind": "const", "value": obj}
    if isinstance(obj, (tuple, list)):
        kind = "list" if isinstance(obj, list) else "tuple"
        return {"kind": kind, "items": [_flatten(v, leaves, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        keys = list(obj)
        if not all(isinstance(k, str) for k in keys):
            raise InputError(f"dict at {path or 'input'} has non-string keys {keys!r}; use string keys")
        return {"kind": "dict", "keys": keys, "items": [_flatten(obj[k], leaves, f"{path}.{k}") for k in keys]}
    raise InputError(
        f"unsupported value of type {type(obj).__name__} at {path or 'input'}: aitune handles tensors, "
        "tuples, lists, dicts with string keys, and JSON scalars (bool, int, float, str, None)"
    )


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
    elif kind in ("tuple", "list"):
        for i, n in enumerate(node["items"]):
            _paths(n, f"{path}.{i}" if path else str(i), out)
    elif kind == "dict":
        for k, n in zip(node["keys"], node["items"]):
            _paths(n, f"{path}.{k}" if path else k, out)


def call_key(obj: Any, leaves: list[torch.Tensor]) -> Any:
    """A cheap hashable key of a call's structure; appends tensor leaves to ``leaves``.

    Tensors contribute dtype, rank and device type (not shape), so calls that differ only in the
    sizes of their axes share a key. This is the per-call dispatch path: keep it allocation-light.
    """
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return (obj.dtype, obj.dim(), obj.device.type)
    if isinstance(obj, (tuple, list)):
        return (type(obj), tuple([call_key(v, leaves) for v in obj]))
    if isinstance(obj, dict):
        return (dict, tuple([(k, call_key(v, leaves)) for k, v in obj.items()]))
    if isinstance(obj, _SCALARS):
        return (type(obj), obj)
    return (type(obj), id(obj))
