"""State objects: inputs a module updates in place, described as tensors plus plain attributes.

transformers' static KV cache (``cache_implementation="static"``) is the kind known: a ``Cache``
whose layers hold preallocated ``keys``/``values`` tensors and a ``cumulative_length`` counter,
all written in place by each decode step, and the encoder-decoder cache that pairs two of them
(Whisper). Its tensors are leaves of the call like any other input, so a backend that supports
input mutation (``Backend.mutates_inputs``) can run the decode step, and validation compares
what the candidate left in them with what eager left.

Bookkeeping that changes every step is not part of a graph: a sliding-window layer
(``StaticSlidingWindowLayer``, Mistral's and Gemma's local attention) also counts its tokens in a
Python int (``cumulative_length_int``) that grows by one each step. Were it a plain attribute,
every step would be another graph (and a compiled step would guard on its value until TorchDynamo's
recompile limit). Such counters (:data:`COUNTERS`) are described as 0-d ``int64`` tensors instead:
the graph's key holds their dtype and rank, not their value, a sample keeps its own value, and a
backend that runs the live call (``torch.compile``) reads the live one, so results equal eager's.

Why an allow-list and no generic "any object": a structure can come from a file, and rebuilding
an object from it must not run the type's code or set anything but tensors, devices, layer flags
and JSON scalars. A cache whose layers are not all static (a ``DynamicCache``, whose tensors grow by
concatenation and are replaced, not updated) is refused with the reason, and its call runs eager.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import UnsupportedValueError

CACHE_BASES = frozenset({"Cache", "CacheLayerMixin"})
"""Base classes (in ``transformers.cache_utils``) a state object's types must derive from."""
STATIC_LAYERS = frozenset({"StaticLayer", "StaticSlidingWindowLayer"})
"""Cache layers that preallocate their tensors and only ever update them in place."""
LAYER_ATTRS = frozenset({"keys", "values", "cumulative_length"})
"""The tensors of a static layer; every other attribute is a JSON scalar or a device."""
LAYER_TENSORS = tuple(sorted(LAYER_ATTRS))
"""The order a layer's tensors are described (and flattened) in."""
COUNTERS = ("cumulative_length_int",)
"""Python ints a layer advances every step, described as 0-d int64 tensors after its tensors
(in this order), so no graph key or compiled guard holds their value."""
_COUNTER_LEAF = torch.zeros((), dtype=torch.int64)
"""What :func:`key_of` hands the per-call path for a counter: only its dtype, rank and device are read."""


def is_cache(cls: type) -> bool:
    """``cls`` derives from transformers' ``Cache`` or ``CacheLayerMixin`` (looked up by name:
    nothing is imported)."""
    return any(base.__module__ == "transformers.cache_utils" and base.__name__ in CACHE_BASES for base in cls.__mro__)


STATE_LAYER_BASES = frozenset({"LinearAttentionCacheLayerMixin"})
"""transformers' layers of recurrent state (Mamba's convolution and SSM states, linear attention):
fixed-size, so a static cache changes nothing for them."""


def _holds_states(cls: type) -> bool:
    return any(
        base.__module__ == "transformers.cache_utils" and base.__name__ in STATE_LAYER_BASES for base in cls.__mro__
    )


def check_layer_type(cls: type) -> None:
    """A ValueError when ``cls`` is a cache layer that is not static: a structure from a file may
    name only the layers :func:`describe` accepts (a ``DynamicLayer`` grows, so no payload holds it)."""
    is_layer = any(
        base.__module__ == "transformers.cache_utils" and base.__name__ == "CacheLayerMixin" for base in cls.__mro__
    )
    if is_layer and cls.__name__ not in STATIC_LAYERS:
        raise ValueError(f"a cache layer is a {cls.__name__}; only {sorted(STATIC_LAYERS)} layers are described")


PAIRED = ("self_attention_cache", "cross_attention_cache")
"""An encoder-decoder cache (Whisper, T5): a cache for the decoder's own attention and one for the
encoder's outputs, each described as a cache of its own."""


def _paired(obj: Any) -> bool:
    """``obj`` is an encoder-decoder cache: two caches, no layers of its own."""
    return not hasattr(obj, "layers") and all(hasattr(obj, a) for a in PAIRED)


def is_state(obj: Any) -> bool:
    """``obj`` is a transformers cache object (static or not): :func:`describe` decides whether it can be described."""
    return not isinstance(obj, type) and is_cache(type(obj)) and (hasattr(obj, "layers") or _paired(obj))


def describe(obj: Any, path: str) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """The plain attributes of a static cache and its children (``layers``), or an
    :class:`UnsupportedValueError` saying why the cache cannot be run by a backend."""
    name = type(obj).__name__
    if _paired(obj):
        return _plain(obj, path, exclude=set(PAIRED)), [(a, getattr(obj, a)) for a in PAIRED]
    layers = getattr(obj, "layers", None)
    if not isinstance(layers, list) or not layers:
        raise UnsupportedValueError(f"the {name} at {path or 'input'} has no layers aitune can describe")
    kinds = {type(layer).__name__ for layer in layers}
    if not kinds <= STATIC_LAYERS:
        others = [layer for layer in layers if type(layer).__name__ not in STATIC_LAYERS]
        shown = ", ".join(sorted(kinds - STATIC_LAYERS))
        if any(_holds_states(type(layer)) for layer in others):  # a static cache would not help: say so
            raise UnsupportedValueError(
                f"{name} at {path or 'input'} has {shown} layers, which keep fixed-size recurrent states (as Mamba "
                "and linear-attention models do) that aitune does not run in a compiled graph, with any "
                "cache_implementation: calls with this cache run eager; call the model with use_cache=False to have "
                "its forward tuned"
            )
        raise UnsupportedValueError(
            f"{name} at {path or 'input'} has {shown} layers, whose tensors grow "
            "with every token (a new tensor each step, not an in-place update), so no compiled graph can hold them: "
            "generate with cache_implementation='static' to have the decode step tuned"
        )
    if not all(getattr(layer, "is_initialized", False) for layer in layers):
        raise UnsupportedValueError(
            f"the {name} at {path or 'input'} is not filled yet: this call (the prefill) creates its tensors, "
            "which no compiled graph can do; it runs eager and the decode steps that follow are tuned"
        )
    attrs = _plain(obj, path, exclude={"layers"})
    return attrs, [("layers", layers)]


def layer_parts(layer: Any, path: str) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """The plain attributes of one static layer, then its tensors and counters, in a fixed order."""
    missing = [a for a in LAYER_TENSORS if not isinstance(getattr(layer, a, None), torch.Tensor)]
    if missing:
        raise UnsupportedValueError(f"the cache layer at {path} has no tensor {missing[0]!r}")
    counters = counters_of(layer)
    for name in counters:
        value = getattr(layer, name)
        if type(value) is not int:
            raise UnsupportedValueError(
                f"the cache layer at {path} holds {name}={type(value).__name__}, a step counter aitune expects as int"
            )
    children = [(a, getattr(layer, a)) for a in LAYER_TENSORS] + [(c, getattr(layer, c)) for c in counters]
    return _plain(layer, path, exclude=LAYER_ATTRS.union(counters)), children


def counters_of(layer: Any) -> tuple[str, ...]:
    """The step counters (:data:`COUNTERS`) ``layer`` holds, in their fixed order."""
    held = vars(layer)
    return tuple(c for c in COUNTERS if c in held)


def counter_slots(value: Any) -> list[tuple[Any, str]]:
    """Every ``(layer, counter name)`` in ``value`` (a call's arguments, nested in tuples, lists and
    dicts), in flatten order: what restoring a recorded call sets back besides its tensors."""
    out: list[tuple[Any, str]] = []
    if isinstance(value, (tuple, list)):
        for v in value:
            out += counter_slots(v)
    elif isinstance(value, dict):
        for v in value.values():
            out += counter_slots(v)
    elif is_state(value):
        if _paired(value):
            for name in PAIRED:
                out += counter_slots(getattr(value, name))
        else:
            out += [(layer, c) for layer in getattr(value, "layers", []) for c in counters_of(layer)]
    return out


def counter_leaf(value: int) -> torch.Tensor:
    """A counter as the tensor leaf a structure holds for it."""
    return torch.tensor(value, dtype=torch.int64)


def _plain(obj: Any, path: str, exclude: frozenset[str] | set[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in vars(obj).items():
        if key in exclude:
            continue
        if isinstance(value, torch.device):
            out[key] = {"device": str(value)}
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[key] = value
        elif isinstance(value, dict) and all(type(k) is int and type(v) is bool for k, v in value.items()):
            out[key] = {"flags": {str(k): v for k, v in value.items()}}  # an encoder-decoder cache's is_updated
        else:
            raise UnsupportedValueError(
                f"the {type(obj).__name__} at {path or 'input'} holds {key}={type(value).__name__}, which aitune "
                "cannot describe (tensors, devices and JSON scalars only)"
            )
    return out


STATE_DEVICES = ("cpu", "cuda")
"""The device types a state attribute read from a file may name: ``meta`` would drop the tensors'
data, and any other type is not one a tuned graph runs on."""
CHILDREN = frozenset({"layers", *PAIRED, *LAYER_TENSORS, *COUNTERS})
"""The attribute names that hold a state object's children (its layers, its two caches, a layer's
tensors and step counters)."""


def attribute_name(cls: type, key: Any) -> str:
    """``key`` when it may be set on a ``cls`` instance rebuilt from a file, else a ValueError.

    An instance attribute hides the class's own of that name: one from a file must never hide a
    method or a property (``get_seq_length``, ``__class__``), only a plain class-level value
    (``is_sliding = True``) the object itself sets too.
    """
    if not isinstance(key, str) or not key.isidentifier() or key.startswith("__"):
        raise ValueError(f"an attribute is named {key!r}, which is not a plain attribute name")
    for klass in cls.__mro__:
        found = vars(klass).get(key)
        if key in vars(klass) and not (found is None or isinstance(found, (bool, int, float, str))):
            raise ValueError(
                f"an attribute is named {key!r}, which would hide {cls.__name__}'s own {type(found).__name__} of that name"
            )
    return key


def attribute_value(value: Any) -> Any:
    """An attribute as :func:`describe` wrote it, back to its value (a device or a JSON scalar)."""
    if isinstance(value, dict) and set(value) == {"flags"} and isinstance(value["flags"], dict):
        flags = value["flags"]
        if not all(isinstance(k, str) and k.isdigit() and type(v) is bool for k, v in flags.items()):
            raise ValueError(f"an attribute holds {value!r}: flags map layer numbers to booleans")
        return {int(k): v for k, v in flags.items()}
    if isinstance(value, dict):
        device = value.get("device")
        if set(value) != {"device"} or not isinstance(device, str):
            raise ValueError(f"an attribute holds {value!r}: only devices, layer flags and JSON scalars are allowed")
        found = torch.device(device)
        if found.type not in STATE_DEVICES:
            raise ValueError(
                f"an attribute names the device {device!r}; a file may only name {' or '.join(STATE_DEVICES)}"
            )
        return found
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"an attribute holds a {type(value).__name__}: only devices and JSON scalars are allowed")


def bare(cls: type, attrs: dict[str, Any]) -> Any:
    """An instance of ``cls`` with ``attrs`` set, made without running any of ``cls``'s code."""
    obj: Any = object.__new__(cls)
    for key, value in attrs.items():
        obj.__dict__[attribute_name(cls, key)] = attribute_value(value)
    return obj


def child_name(cls: type, key: Any) -> str:
    """``key`` when it names where a state object keeps a child (:data:`CHILDREN`), else a ValueError."""
    if key not in CHILDREN:
        raise ValueError(f"a child is named {key!r}; a state object keeps its children at {sorted(CHILDREN)} only")
    return attribute_name(cls, key)


def key_of(obj: Any, leaves: list[torch.Tensor]) -> Any:
    """A hashable key of a static cache's form (its attributes, its tensors' dtype and rank);
    appends its tensors to ``leaves`` in :func:`describe`'s order. Not a valid cache: identity."""
    if _paired(obj):
        both: list[torch.Tensor] = []
        flags = tuple(sorted(getattr(obj, "is_updated", {}).items()))
        paired = (type(obj), flags, *(key_of(getattr(obj, a), both) for a in PAIRED))
        leaves.extend(both)
        return paired
    layers = getattr(obj, "layers", None)
    if not isinstance(layers, list) or not all(type(la).__name__ in STATIC_LAYERS for la in layers):
        return (type(obj), id(obj))
    found: list[torch.Tensor] = []
    try:
        parts: list[Any] = [type(obj), tuple(sorted((k, v) for k, v in vars(obj).items() if k != "layers"))]
        for layer in layers:
            held = vars(layer)
            counters = [c for c in COUNTERS if c in held]
            plain = tuple(sorted((k, v) for k, v in held.items() if k not in LAYER_ATTRS and k not in counters))
            tensors = [getattr(layer, a) for a in LAYER_TENSORS]
            parts.append((type(layer), plain, tuple((t.dtype, t.dim(), t.device.type) for t in tensors), *counters))
            found.extend(tensors)
            found.extend(_COUNTER_LEAF for _ in counters)
        key = tuple(parts)
        hash(key)  # attribute values are hashed as they are (no repr on this per-call path)
    except (AttributeError, TypeError):  # not filled yet (the prefill), or an odd attribute: identity, runs eager
        return (type(obj), id(obj))
    leaves.extend(found)
    return key
