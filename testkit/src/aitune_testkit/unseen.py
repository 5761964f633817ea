"""Backends wrong only where validation used not to look, and a module for padded batches.

``WrongAtSixBackend`` answers wrongly for one size of axis 1 (6), as an export that dropped a
shape guard does for a size the recorded calls never had. ``GarblesPaddingBackend`` is right at
every position an attention mask keeps and wrong at the padded ones, as ONNX Runtime is on a
left-padded decoder batch. ``MaskedEncoder`` takes ``(x, attention_mask)``.
"""

from __future__ import annotations

from typing import Any

import torch

from aitune import hookimpl
from aitune.registry import BackendRegistry
from aitune.testing.backends import ToyBackend, register


class MaskedEncoder(torch.nn.Module):
    """``[batch, seq, 8]`` and a ``[batch, seq]`` mask in, ``[batch, seq, 8]`` and a pooled ``[batch, 8]`` out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.fc(x))
        keep = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1)
        return h, pooled


class WrongAtSixBackend(ToyBackend):
    name = "toy_wrong_at_six"

    def transform(self, output: Any, args: tuple[Any, ...]) -> Any:
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 1 and args[0].shape[1] == 6:
            return -output
        return output


class Int8LikeBackend(ToyBackend):
    """Off by about 3% of the output's scale, the way an int8 graph is, but keeps every row's argmax."""

    name = "toy_int8_like"

    def transform(self, output: Any, args: tuple[Any, ...]) -> Any:
        return output * 1.02 + 0.01 * output.abs().max()


class GarblesPaddingBackend(ToyBackend):
    name = "toy_garbles_padding"

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        hidden, pooled = super().infer(*args, **kwargs)
        mask = kwargs["attention_mask"] if "attention_mask" in kwargs else args[1]
        return hidden.masked_fill((mask == 0).unsqueeze(-1), 1000.0), pooled


@hookimpl
def aitune_register_backends(registry: BackendRegistry) -> None:
    register(registry, (WrongAtSixBackend, GarblesPaddingBackend, Int8LikeBackend), __name__)
