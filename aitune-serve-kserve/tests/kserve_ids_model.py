"""A token-id model for the kserve engine's tests, importable by name in the server's process
(``--factory kserve_ids_model:build``): ids through an embedding of :data:`VOCAB` rows."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 50
LENGTH = 6


class Tokens(torch.nn.Module):
    """``input_ids: [batch, 6]`` (int64) to ``[batch, 3]``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids).mean(dim=1))


def build() -> torch.nn.Module:
    return Tokens().eval()


def tune(path: str | Path) -> Path:
    """Tuned with ONNX Runtime (its Gather wraps id -1 where eager raises) on ids 5..29, batches 2 and 4."""
    import aitune.torch as ait
    from aitune.torch.backend import ONNXRuntimeBackend

    model = ait.Module(
        build(), "tokens", strategy=ait.FirstWinsStrategy([ONNXRuntimeBackend()], performance_validation=False)
    )
    g = torch.Generator().manual_seed(0)
    ait.tune(model, [torch.randint(5, 30, (b, LENGTH), generator=g) for b in (2, 4)])
    ait.save(model, path)
    return Path(path)
