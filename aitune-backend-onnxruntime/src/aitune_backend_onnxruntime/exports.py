"""One ONNX export per graph, shared by the ONNX Runtime variants that consume the same one.

The plain and the int8 variants (and any other that differs only after the export: provider,
optimisation level, threads) run the same exported graph. Exporting takes seconds to minutes on a
real model; the second variant built for the same graph copies the first one's files instead.

An export is reused only for the very same call: the same module (its weights unchanged: same
tensors, same version counters), the same graph, export config and attention implementation, and
the same recorded sample tensors (compared by identity), so a new tune, new weights or new
recordings always export again. The files are copied out of the folder of the candidate that
exported them, while that candidate is alive and its files are there; otherwise it exports again.
"""

from __future__ import annotations

import shutil
import weakref
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from aitune.plugin import ONNXExport, Sample

MAX_PER_MODULE = 8
"""Exports remembered per module (the oldest dropped first)."""


@attrs.frozen(eq=False)
class _Entry:
    export: ONNXExport
    owner: weakref.ref[Any]
    """The backend whose folder holds the files (gone with it)."""
    tensors: tuple[weakref.ref[torch.Tensor], ...]
    """The recorded samples' tensors the export was made from."""


_shared: weakref.WeakKeyDictionary[torch.nn.Module, dict[Hashable, _Entry]] = weakref.WeakKeyDictionary()


def _weights(module: torch.nn.Module) -> tuple[Any, ...]:
    return tuple((k, t.data_ptr(), t._version) for k, t in module.state_dict(keep_vars=True).items())


def _tensors(samples: Sequence[Sample]) -> list[torch.Tensor]:
    return [t for s in samples for t in s.tensors()]


def shared_export(
    module: torch.nn.Module,
    key: Hashable,
    samples: Sequence[Sample],
    owner: object,
    folder: Path,
    export: Callable[[], ONNXExport],
) -> tuple[ONNXExport, bool]:
    """The export for ``key`` in ``folder``: copied from an earlier identical one, or made by
    ``export()`` (and remembered, owned by ``owner``). True when it was copied."""
    full_key = (key, _weights(module))
    tensors = _tensors(samples)
    entries = _shared.setdefault(module, {})
    entry = entries.get(full_key)
    if entry is not None and _same(entry, tensors) and entry.owner() is not None:
        source = entry.export.path.parent
        if source != folder and all((source / name).is_file() for name in entry.export.files):
            for name in entry.export.files:
                shutil.copy2(source / name, folder / name)
            return attrs.evolve(entry.export, path=folder / entry.export.path.name, seconds=0.0), True
    made = export()
    entries.pop(full_key, None)
    entries[full_key] = _Entry(made, weakref.ref(owner), tuple(weakref.ref(t) for t in tensors))
    while len(entries) > MAX_PER_MODULE:
        del entries[next(iter(entries))]
    return made, False


def _same(entry: _Entry, tensors: list[torch.Tensor]) -> bool:
    return len(entry.tensors) == len(tensors) and all(ref() is t for ref, t in zip(entry.tensors, tensors))
