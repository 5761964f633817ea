"""``ait.wrap``: wrap chosen submodules of a model or pipeline in place."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import InputError
from .module import Module

if TYPE_CHECKING:
    from .strategies import TuneStrategy


def wrap(
    obj: Any,
    modules: Sequence[Any],
    strategy: TuneStrategy | None = None,
    strategies: Sequence[TuneStrategy] | Mapping[int | str, TuneStrategy] | None = None,
) -> Any:
    """Replace each module in ``modules`` with an ``ait.Module`` named after its path; returns ``obj``.

    ``modules`` holds dotted paths (``"encoder"``, ``"unet.down.0"``) or what
    ``ait.inspect(...).get_modules()`` returns. ``obj`` is an ``nn.Module`` or any object holding
    modules as attributes (a pipeline).
    """
    for item in modules:
        path = _path_of(item)
        current = resolve(obj, path)
        if isinstance(current, Module):
            continue
        if not isinstance(current, torch.nn.Module):
            raise InputError(f"{path!r} is a {type(current).__name__}, not a torch.nn.Module")
        place(obj, path, Module(current, name=path, strategy=strategy, strategies=strategies))
    return obj


def _path_of(item: Any) -> str:
    from .inspection import ModuleInfo  # on use: it imports the tuner, which ait.load's resolve and place need not

    path = item.name if isinstance(item, ModuleInfo) else item
    if not isinstance(path, str):
        raise InputError(
            f"ait.wrap takes dotted module paths or the module infos of ait.inspect(...).get_modules(), got {item!r}"
        )
    if not path:
        raise InputError("ait.wrap cannot wrap the object itself in place: use model = ait.Module(model, 'name')")
    return path


def resolve(obj: Any, path: str) -> Any:
    """What sits at the dotted ``path`` of ``obj`` (``""``: ``obj``); wrappers are looked through."""
    if not path:
        return obj
    parent, attr = _parent(obj, path)
    return _get(parent, attr, path)


def place(obj: Any, path: str, value: torch.nn.Module) -> None:
    """Put ``value`` at the dotted ``path`` of ``obj``, where a module is now."""
    parent, attr = _parent(obj, path)
    if isinstance(parent, Module):
        parent = parent.module
    if isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential, list)) and attr.isdigit():
        parent[int(attr)] = value
    elif isinstance(parent, (MutableMapping, torch.nn.ModuleDict)):
        parent[attr] = value
    elif isinstance(parent, tuple):
        raise InputError(f"cannot replace {path!r}: it sits in a tuple; hold the modules in a list or attributes")
    else:
        setattr(parent, attr, value)


def _parent(obj: Any, path: str) -> tuple[Any, str]:
    parts = path.split(".")
    node = obj
    for i, part in enumerate(parts[:-1]):
        node = _get(node, part, ".".join(parts[: i + 1]))
    return node, parts[-1]


def _get(node: Any, attr: str, path: str) -> Any:
    if isinstance(node, Module):
        node = node.module
    if isinstance(node, (torch.nn.ModuleList, torch.nn.Sequential, list, tuple)) and attr.isdigit():
        if int(attr) < len(node):
            return node[int(attr)]
    elif isinstance(node, (Mapping, torch.nn.ModuleDict)):
        if attr in node:
            return node[attr]
    elif hasattr(node, attr):
        return getattr(node, attr)
    raise InputError(f"cannot find {path!r}: {type(node).__name__} has no {attr!r}")
