"""``ait.wrap``: wrap chosen submodules of a model or pipeline in place."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import InputError
from .module import Module
from .strategies import TuneStrategy


def wrap(
    obj: Any,
    modules: Sequence[str],
    strategy: TuneStrategy | None = None,
    strategies: Sequence[TuneStrategy] | Mapping[int | str, TuneStrategy] | None = None,
) -> Any:
    """Replace each dotted path in ``modules`` (``"encoder"``, ``"unet.down.0"``) with an ``ait.Module``.

    ``obj`` is an ``nn.Module`` or any object holding modules as attributes (a pipeline). The
    wrapper is named after its path. Returns ``obj``.
    """
    for path in modules:
        parent, attr = _parent(obj, path)
        current = _get(parent, attr, path)
        if isinstance(current, Module):
            continue
        if not isinstance(current, torch.nn.Module):
            raise InputError(f"{path!r} is a {type(current).__name__}, not a torch.nn.Module")
        wrapped = Module(current, name=path, strategy=strategy, strategies=strategies)
        if isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential)) and attr.isdigit():
            parent[int(attr)] = wrapped
        elif isinstance(parent, torch.nn.ModuleDict):
            parent[attr] = wrapped
        else:
            setattr(parent, attr, wrapped)
    return obj


def _parent(obj: Any, path: str) -> tuple[Any, str]:
    parts = path.split(".")
    node = obj
    for i, part in enumerate(parts[:-1]):
        node = _get(node, part, ".".join(parts[: i + 1]))
    return node, parts[-1]


def _get(node: Any, attr: str, path: str) -> Any:
    if isinstance(node, Module):
        node = node.module
    if isinstance(node, (torch.nn.ModuleList, torch.nn.Sequential)) and attr.isdigit():
        if int(attr) < len(node):
            return node[int(attr)]
    elif isinstance(node, (Mapping, torch.nn.ModuleDict)):
        if attr in node:
            return node[attr]
    elif hasattr(node, attr):
        return getattr(node, attr)
    raise InputError(f"cannot find {path!r}: {type(node).__name__} has no {attr!r}")
