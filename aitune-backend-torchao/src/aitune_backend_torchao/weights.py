"""Quantized weights to and from safetensors, through torchao's own flattening of its tensor types.

Only the quantized tensors are written: the artifact already holds the module's original weights,
and loading puts the quantized ones back onto a copy of that module. A tensor type torchao cannot
flatten makes :func:`save` write nothing, and the backend re-quantizes at load instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from aitune.plugin import SerializationError

from .config import DTYPES

FILE = "quantized.safetensors"


def quantized_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state-dict entries that torchao replaced with its tensor subclasses."""
    return {k: v for k, v in model.state_dict().items() if type(v) not in (torch.Tensor, torch.nn.Parameter)}


def save(model: torch.nn.Module, directory: Path) -> bool:
    """Write the quantized tensors to ``directory``; False (nothing written) when torchao cannot flatten them."""
    from safetensors.torch import save_file

    try:
        from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
        from torchao.prototype.safetensors.safetensors_utils import ALLOWED_TENSORS_SUBCLASSES
    except ImportError:
        return False
    tensors = quantized_tensors(model)
    if any(type(t).__name__ not in ALLOWED_TENSORS_SUBCLASSES for t in tensors.values()):
        return False
    path = directory / FILE
    try:
        flat, metadata = flatten_tensor_state_dict(tensors)
        save_file({k: v.contiguous() for k, v in flat.items()}, str(path), metadata=metadata)
    except (ValueError, RuntimeError, TypeError):
        path.unlink(missing_ok=True)
        return False
    return True


def load(model: torch.nn.Module, directory: Path, device: torch.device, expected: list[str]) -> None:
    """Put the saved quantized tensors into ``model`` (a copy of the eager module), in place."""
    from safetensors import safe_open
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    path = directory / FILE
    if not path.is_file():
        raise SerializationError(f"the torchao payload has no {FILE}; the artifact is incomplete, re-save it")
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        metadata = f.metadata() or {}
        flat = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no items()
    _check_dtypes(metadata)
    try:
        tensors, leftover = unflatten_tensor_state_dict(flat, metadata)
    except (ValueError, KeyError, TypeError) as exc:
        raise SerializationError(
            f"torchao cannot read the saved quantized weights ({exc}); the installed torchao may use another "
            "layout than the one that saved them: re-tune with this torchao"
        ) from exc
    if leftover or sorted(tensors) != sorted(expected):
        raise SerializationError(
            f"the saved quantized weights ({sorted(tensors)}) do not match the payload's list ({sorted(expected)})"
        )
    for name, tensor in tensors.items():
        owner, _, attr = name.rpartition(".")
        try:
            sub = model.get_submodule(owner)
        except AttributeError:
            raise SerializationError(f"the module has no submodule {owner!r} for the saved weight {name!r}") from None
        if attr in sub._parameters:
            sub._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
        elif attr in sub._buffers:
            sub._buffers[attr] = tensor
        else:
            raise SerializationError(f"the module has no weight {name!r} to put the saved quantized tensor in")
    for p in model.parameters():
        p.requires_grad_(False)


def _check_dtypes(metadata: dict[str, str]) -> None:
    """Refuse a dtype named outside :data:`~.config.DTYPES` before torchao reads the metadata: its
    reader returns ``getattr(torch, name)`` for any name, a function as well as a dtype."""

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            if node.get("_type") == "torch.dtype" and node.get("_data") not in DTYPES:
                raise SerializationError(
                    f"the saved quantized weight {where} names the dtype {node.get('_data')!r}, which is not one of "
                    f"{', '.join(DTYPES)}; the payload is corrupt or hostile"
                )
            for value in node.values():
                walk(value, where)
        elif isinstance(node, list):
            for value in node:
                walk(value, where)

    for name, text in metadata.items():
        try:
            walk(json.loads(text), name)
        except ValueError:
            continue  # not JSON: torchao's reader refuses it on its own
