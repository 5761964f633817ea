"""Hostile backend configs: what a crafted artifact may put where a config belongs.

A config read from a file (an artifact, a cache entry, the JIT store) is data. Reading it, through
:meth:`aitune.registry.BackendRegistry.config_from_json` with ``from_file=True``, must call
nothing and import nothing the file names, and a config that comes out must hold no callable and
no object that names its own type. :func:`config_problems` feeds each field of a backend's config
(and of the attrs classes inside it) every value of :func:`hostile_values` and says, in words,
where that promise broke. A plain string that survives is data and may stay; no hostile value
names a type a backend allow-lists, so a typed object that survives is a failure.
:class:`~aitune.testing.BackendConformance` runs it for every backend, so a third-party backend is
held to the same rule as aitune's own.
"""

from __future__ import annotations

import importlib.abc
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import attrs
import torch

from ..converter import unstructure
from ..errors import AituneError

MISSING_MODULE = "aitune_hostile_probe_module"
"""A module that does not exist: any attempt to import it is seen, and fails."""
PROBE = "aitune.testing.hostile:probe"
calls: list[Any] = []
"""Every call of :func:`probe` (a hostile config made something call it)."""


def probe(*args: Any, **kwargs: Any) -> None:
    """What a hostile file names to be called: records that it was."""
    calls.append((args, kwargs))


def hostile_values() -> list[Any]:
    """Values a crafted file may give a config field: callables, names of callables and modules,
    torchao-style ``{"_type", "_data"}`` objects, dtypes and torch functions by name."""
    names = [PROBE, PROBE.replace(":", "."), f"{MISSING_MODULE}:run", f"{MISSING_MODULE}.run"]
    typed = [{"_type": name, "_data": {}} for name in names]
    return [
        probe,
        *names,
        *typed,
        {"_type": "torch.dtype", "_data": "manual_seed"},
        {"_type": "torch.dtype", "_data": "set_default_device"},
        {"_type": "torch.dtype", "_data": "float64"},
        {"_type": "Int8WeightOnlyConfig", "_data": {"granularity": {"_type": f"{MISSING_MODULE}.Run", "_data": {}}}},
        {
            "_type": "Int8WeightOnlyConfig",
            "_version": 2,
            "_data": {"group_size": {"_type": "torch.dtype", "_data": "manual_seed"}},
        },
        {"py/object": PROBE},
        {"__class__": PROBE, "args": [f"{MISSING_MODULE}"]},
        "torch.float64",
        "float64",
        ["torch.float64", PROBE],
    ]


class _ImportWatch(importlib.abc.MetaPathFinder):
    """Sees every import that is not answered from ``sys.modules``; finds nothing itself."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        self.names.append(fullname)
        return None


@contextmanager
def watching_imports() -> Iterator[_ImportWatch]:
    watch = _ImportWatch()
    sys.meta_path.insert(0, watch)
    try:
        yield watch
    finally:
        sys.meta_path.remove(watch)


def _torch_state() -> tuple[Any, ...]:
    device = torch.get_default_device() if hasattr(torch, "get_default_device") else None
    return torch.get_default_dtype(), device, bytes(torch.random.get_rng_state().numpy())


def _carries_hostile(value: Any) -> bool:
    """Whether the JSON form of a config still holds a callable or an object that names its own type
    (``_type``, ``py/object``, ``__class__``): what a reader could later look up and call. A plain
    string is data (an op name, a pattern) and may stay."""
    if callable(value) and not isinstance(value, type):
        return True
    if isinstance(value, dict):
        return bool({"_type", "py/object", "__class__"} & set(value)) or any(
            _carries_hostile(v) for v in value.values()
        )
    if isinstance(value, (list, tuple)):
        return any(_carries_hostile(v) for v in value)
    return False


def _field_paths(cls: type, prefix: tuple[str, ...] = (), depth: int = 0) -> list[tuple[str, ...]]:
    """Every field of an attrs class, and the fields of attrs classes in it (two levels), by path."""
    out = [prefix] if prefix else []
    if depth > 2 or not attrs.has(cls):
        return out
    with suppress(Exception):  # an annotation naming something not importable here: the fields as they are
        attrs.resolve_types(cls)
    for field in attrs.fields(cls):
        inner = field.type if isinstance(field.type, type) and attrs.has(field.type) else None
        if inner is not None:
            out += _field_paths(inner, (*prefix, field.name), depth + 1)
        else:
            out.append((*prefix, field.name))
    return out


def _nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    data: Any = value
    for name in reversed(path):
        data = {name: data}
    return data


def config_problems(registry: Any, backend: str) -> list[str]:
    """Where reading ``backend``'s config from a file called, imported or kept something hostile.

    Each field gets each hostile value, and the config itself an extra ``_type`` key. Refusing a
    value (an :class:`~aitune.errors.AituneError`) is right; so is keeping a plain value. Wrong:
    any other exception, a call of :func:`probe`, an import of a module the value names (or of
    anything at all), torch's default dtype, device or random state changing, and a config that
    comes out still naming something hostile.
    """
    config_class = registry.config_class(backend)
    cases = [({"_type": PROBE}, "the config's own _type key")]
    for path in _field_paths(config_class):
        cases += [(_nested(path, value), f"{'.'.join(path)}={value!r}") for value in hostile_values()]
    problems: list[str] = []
    _torch_state()  # its first call imports torch.utils._device
    for data, _ in cases:  # once unwatched, so what reading a config imports the first time is not counted
        with suppress(Exception):
            registry.config_from_json({"backend": backend, **data}, "config", from_file=True)
    for data, what in cases:
        calls.clear()
        before_modules, before_torch = set(sys.modules), _torch_state()
        outcome = "accepted"
        with watching_imports() as watch:
            try:
                config = registry.config_from_json({"backend": backend, **data}, "config", from_file=True)
            except AituneError:
                outcome, config = "refused", None
            except Exception as exc:
                problems.append(f"{what}: raised {type(exc).__name__} ({exc}), not an aitune error")
                continue
        if calls:
            problems.append(f"{what}: called {PROBE}")
        imported = [n for n in watch.names if MISSING_MODULE in n] or sorted(set(sys.modules) - before_modules)
        if imported:
            problems.append(f"{what}: imported {', '.join(imported[:5])}")
        if _torch_state() != before_torch:
            problems.append(f"{what}: changed torch's default dtype, default device or random state")
        if outcome == "accepted":
            try:
                form = unstructure(config)
                json.dumps(form)
            except (TypeError, ValueError):
                problems.append(f"{what}: accepted, into a config with no JSON form (it holds an object)")
                continue
            if _carries_hostile(form):
                problems.append(f"{what}: accepted, and the config still holds it: {form!r}")
    return problems
