"""Nested inputs and outputs as flat tensor lists plus a JSON-able structure.

A module call is ``(args, kwargs)`` with tensors nested in containers, next to plain values
(ints, strings, None, enum members...). Backends such as ONNX or TensorRT see only a flat list of
tensors; the structure says how to put them back, in the very types the module used: a tuned
module returns a ``NamedTuple``, a dataclass or a ``transformers`` ``ModelOutput`` where eager did.
The structure is plain JSON so it can live in a manifest; a type is named by its path
(``module:QualName``). A structure may come from a file, so it is data only: a type resolves only
among modules this process has already imported (never by importing what a file names), and a
value is rebuilt without calling the type's own constructor (fields set on a bare instance, a
named tuple made as a tuple); a registered pytree node gets its JSON context as it is.

Structure nodes::

    {"kind": "tensor"}                                    one tensor leaf
    {"kind": "const", "value": 3}                         a JSON scalar
    {"kind": "enum", "type": "pkg.mod:Color", "name": "RED"}
    {"kind": "tuple" | "list", "items": [...]}
    {"kind": "dict", "keys": ["a", "b"], "items": [...]}
    {"kind": "namedtuple" | "dataclass" | "mapping", "type": "pkg.mod:Out", "keys": [...], "items": [...]}
    {"kind": "pytree", "type": "pkg.mod:Node", "context": <JSON>, "items": [...]}
    {"kind": "state", "type": "pkg.mod:Cache", "attrs": {...}, "keys": [...], "items": [...]}
    {"kind": "counter"}                                   a state's step counter: an int, as a 0-d int64 leaf

``mapping`` is a dict subclass (``OrderedDict``, ``ModelOutput``); ``pytree`` is any other type
registered with ``torch.utils._pytree`` whose context is JSON; ``state`` is an object the module
updates in place (a static KV cache, see :mod:`aitune.state`), rebuilt as a bare instance whose
attributes are JSON scalars, devices and its children.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from . import state
from .errors import InputError, UnsupportedValueError

_SCALARS = (bool, int, float, str, type(None))
_TYPED = ("namedtuple", "dataclass", "mapping")


def flatten(obj: Any, path: str = "") -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Split ``obj`` into its tensor leaves (depth-first order) and its structure.

    Raises :class:`UnsupportedValueError` naming the path of a value no backend can take.
    """
    leaves: list[torch.Tensor] = []
    return leaves, _flatten(obj, leaves, path)


class CallLeaves:
    """The tensor leaves of a call ``(args, kwargs)`` made the way ``structure`` (a call's structure,
    as :func:`flatten` gives it for ``(args, kwargs)``) says, for a backend's per-call path.

    A call of tensors only, positional and by keyword, is read off directly: its positional
    tensors, then its keyword tensors in the structure's key order (a backend's inputs follow that
    order), with no walk and no structure built. Any other structure, or a call whose positional
    count or keywords differ from it, is flattened as :func:`flatten` does.
    """

    __slots__ = ("keys", "n_args")

    def __init__(self, structure: dict[str, Any]) -> None:
        self.n_args: int | None = None
        self.keys: tuple[str, ...] = ()
        try:
            if structure["kind"] != "tuple":
                return
            args_node, kwargs_node = structure["items"]
            if args_node["kind"] != "tuple" or kwargs_node["kind"] != "dict":
                return
            if all(n["kind"] == "tensor" for n in (*args_node["items"], *kwargs_node["items"])):
                keys = tuple(kwargs_node["keys"])
                if all(isinstance(k, str) for k in keys) and len(keys) == len(kwargs_node["items"]):
                    self.n_args, self.keys = len(args_node["items"]), keys
        except (KeyError, TypeError, ValueError, IndexError):  # not a call's structure (it may come from a file)
            return

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Sequence[torch.Tensor]:
        keys = self.keys
        if len(args) == self.n_args and len(kwargs) == len(keys):
            if not keys:
                return args
            try:
                return [*args, *[kwargs[k] for k in keys]] if args else [kwargs[k] for k in keys]
            except KeyError:  # other keywords: flattened below, as they come
                pass
        return flatten((args, kwargs))[0]


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
    if state.is_state(obj):
        attrs, children = state.describe(obj, path)
        return _state_node(cls, attrs, children, leaves, path)
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


def _state_node(
    cls: type, attrs: dict[str, Any], children: list[tuple[str, Any]], leaves: list[torch.Tensor], path: str
) -> dict[str, Any]:
    """A state object (see :mod:`aitune.state`): its plain attributes, then its children by name."""
    items = []
    for key, value in children:
        where = f"{path}.{key}"
        if isinstance(value, list):  # a cache's layers
            nodes = []
            for i, layer in enumerate(value):
                layer_attrs, tensors = state.layer_parts(layer, f"{where}.{i}")
                nodes.append(_state_node(type(layer), layer_attrs, tensors, leaves, f"{where}.{i}"))
            items.append({"kind": "list", "items": nodes})
        elif key in state.COUNTERS:  # its value is data, not structure (see aitune.state)
            leaves.append(state.counter_leaf(value))
            items.append({"kind": "counter"})
        else:
            items.append(_flatten(value, leaves, where))
    keys = [key for key, _ in children]
    return {"kind": "state", "type": type_path(cls, path), "attrs": attrs, "keys": keys, "items": items}


def _pytree_node(obj: Any, leaves: list[torch.Tensor], path: str) -> dict[str, Any]:
    cls = type(obj)
    children, context = pytree.SUPPORTED_NODES[cls].flatten_fn(obj)
    try:
        ok = _json_context(cls) and json.loads(json.dumps(context)) == context
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise UnsupportedValueError(
            f"{cls.__name__} at {path or 'input'} is known to torch.utils._pytree, but its context is not JSON, "
            "so it cannot be described in an artifact"
        )
    items = [_flatten(v, leaves, f"{path}.{i}") for i, v in enumerate(children)]
    return {"kind": "pytree", "type": type_path(cls, path), "context": context, "items": items}


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


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@functools.lru_cache(maxsize=512)
def resolve(name: str) -> type:
    """The class a structure names, found among the modules already imported; nothing is imported.

    A structure can come from a file: importing what it names would run that module's code (a
    ``__main__`` that runs tests, a module that opens a browser). The program that built the model
    has imported the types its outputs use, so looking them up is enough.
    """
    module_name, _, qualname = name.partition(":")
    if not module_name or any(c.isspace() for c in module_name) or not _NAME.match(qualname):
        raise InputError(f"{name!r} is not a type path (module:QualName)")
    module = sys.modules.get(module_name)
    if module is None:
        raise InputError(
            f"the type {name!r} named in the output or input structure is not loaded in this process, and aitune "
            f"never imports a module because a file names it: import {module_name.split('.')[0]} (the library "
            "that defines it) before loading, as building the model usually does"
        )
    obj: Any = module
    for part in qualname.split("."):
        found = vars(obj).get(part) if hasattr(obj, "__dict__") else None  # no __getattr__: nothing runs
        if found is None:
            raise InputError(f"the type {name!r} named in the structure does not exist in {module_name}")
        obj = found
    if not isinstance(obj, type):
        raise InputError(f"{name!r} names {type(obj).__name__}, not a class")
    return obj


def check_types(structure: dict[str, Any]) -> None:
    """Import every type ``structure`` names; raise :class:`InputError` for one that cannot be
    imported, or for a structure that is not one (it comes from a file)."""
    try:
        kind = structure["kind"]
        if kind in (*_TYPED, "enum", "pytree", "state"):
            _checked(kind, str(structure["type"]))
        if kind == "state":
            cls = _checked(kind, str(structure["type"]))
            state.check_layer_type(cls)
            for key, value in dict(structure["attrs"]).items():
                state.attribute_name(cls, key)
                state.attribute_value(value)
            for key in structure["keys"]:
                state.child_name(cls, key)
        items = structure.get("items", [])
        if not isinstance(items, list):
            raise TypeError(f"items is a {type(items).__name__}")
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
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
        "pytree": cls in pytree.SUPPORTED_NODES and _json_context(cls),
        "state": state.is_cache(cls),
    }.get(kind, False)
    if not ok:
        raise InputError(f"the structure names {name!r} as a {kind}, but it is not one; the structure is corrupt")
    return cls


def _json_context(cls: type) -> bool:
    """A pytree node whose context is used as the JSON it is; one that decodes its context (a
    ``defaultdict`` names its factory, which decoding would look up and the node would call) is refused."""
    serial = pytree.SUPPORTED_SERIALIZED_TYPES.get(cls)
    return not (serial and serial.from_dumpable_context)


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
    if kind == "counter":
        return int(next(it))
    if kind == "tuple":
        return tuple(_unflatten(n, it) for n in node["items"])
    if kind == "list":
        return [_unflatten(n, it) for n in node["items"]]
    if kind == "dict":
        return {k: _unflatten(n, it) for k, n in zip(node["keys"], node["items"])}
    if kind == "enum":
        name = node["name"]
        member = vars(_checked(kind, node["type"]))["_member_map_"].get(name) if isinstance(name, str) else None
        if member is None:
            raise InputError(f"{node['type']} has no member {node['name']!r}; the structure is corrupt")
        return member
    if kind in _TYPED:
        cls = _checked(kind, node["type"])
        return _rebuild(kind, cls, node["keys"], [_unflatten(n, it) for n in node["items"]])
    if kind == "pytree":
        cls = _checked(kind, node["type"])
        return pytree.SUPPORTED_NODES[cls].unflatten_fn([_unflatten(n, it) for n in node["items"]], node["context"])
    if kind == "state":
        try:
            cls = _checked(kind, node["type"])
            state.check_layer_type(cls)
            obj = state.bare(cls, dict(node["attrs"]))
            names = [state.child_name(type(obj), key) for key in node["keys"]]
        except ValueError as exc:
            raise InputError(f"{node['type']}: {exc}; the structure is corrupt") from None
        for key, child in zip(names, node["items"]):
            obj.__dict__[key] = _unflatten(child, it)
        return obj
    raise InputError(f"unknown structure node kind {kind!r}")


def _rebuild(kind: str, cls: type, keys: list[str], values: list[Any]) -> Any:
    """An instance of ``cls`` holding ``values``, made without running ``cls``'s own code.

    A named tuple is made as the tuple it is; a dataclass as a bare instance whose fields are set
    (they hold what the eager call returned, after its ``__post_init__``); a dict subclass
    (``ModelOutput``) the same, its items filled as ``dict`` (or ``OrderedDict``) fills them.
    """
    if kind == "namedtuple":
        return tuple.__new__(cls, values)
    obj: Any
    if kind == "mapping":
        obj = dict.__new__(cls)
        # an OrderedDict (ModelOutput is one) keeps its order beside the dict: fill it as OrderedDict does
        put = collections.OrderedDict.__setitem__ if issubclass(cls, collections.OrderedDict) else dict.__setitem__
        for key, value in zip(keys, values):
            put(obj, key, value)
    else:
        obj = object.__new__(cls)
    if dataclasses.is_dataclass(cls):
        for key, value in zip(keys, values):
            object.__setattr__(obj, key, value)
    return obj


def leaf_paths(structure: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of the tensor leaves, in flatten order (``args.0``, ``kwargs.mask``)."""
    out: list[str] = []
    _paths(structure, prefix, out)
    return out


def _paths(node: dict[str, Any], path: str, out: list[str]) -> None:
    kind = node["kind"]
    if kind in ("tensor", "counter"):
        out.append(path)
    elif "keys" in node:
        for k, n in zip(node["keys"], node["items"]):
            _paths(n, f"{path}.{k}" if path else k, out)
    elif "items" in node:
        for i, n in enumerate(node["items"]):
            _paths(n, f"{path}.{i}" if path else str(i), out)


def leaf_kinds(structure: dict[str, Any]) -> list[str]:
    """Per leaf, in flatten order: ``"tensor"``, or ``"counter"`` for a state's step counter."""
    out: list[str] = []
    _kinds(structure, out)
    return out


def _kinds(node: dict[str, Any], out: list[str]) -> None:
    if node["kind"] in ("tensor", "counter"):
        out.append(node["kind"])
    for n in node.get("items", ()):
        _kinds(n, out)


def call_key(obj: Any, leaves: list[torch.Tensor]) -> Any:
    """A cheap hashable key of a call's structure; appends tensor leaves to ``leaves``.

    Tensors contribute dtype, rank and device type (not shape), so calls that differ only in the
    sizes of their axes share a key; constants contribute their value (objects: their identity).
    This is the per-call dispatch path: keep it allocation-light (tensors in a container are keyed
    inline, without a call per leaf).
    """
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return tensor_key(obj)
    if isinstance(obj, (tuple, list)):
        parts = []
        for v in obj:
            if isinstance(v, torch.Tensor):  # tensor_key, inlined: a call per leaf costs a tenth of a microsecond
                leaves.append(v)
                parts.append((v.dtype, v.ndim, "cpu" if v.is_cpu else "cuda" if v.is_cuda else v.device.type))
            else:
                parts.append(call_key(v, leaves))
        return (type(obj), tuple(parts))
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if isinstance(v, torch.Tensor):  # tensor_key, inlined
                leaves.append(v)
                items.append((k, (v.dtype, v.ndim, "cpu" if v.is_cpu else "cuda" if v.is_cuda else v.device.type)))
            else:
                items.append((k, call_key(v, leaves)))
        return (type(obj), tuple(items))
    if isinstance(obj, _SCALARS):
        return (type(obj), obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj), tuple([call_key(getattr(obj, f.name), leaves) for f in dataclasses.fields(obj)]))
    if state.is_state(obj):
        return state.key_of(obj, leaves)
    return (type(obj), id(obj))


def tensor_key(t: torch.Tensor) -> tuple[torch.dtype, int, str]:
    """A tensor's dtype, rank and device type. ``t.device.type`` builds a device object and a string
    (about a microsecond); ``is_cpu`` and ``is_cuda`` are flags read in a tenth of that, and name
    the same type."""
    return (t.dtype, t.ndim, "cpu" if t.is_cpu else "cuda" if t.is_cuda else t.device.type)
