"""A tiny model to serve in tests and the serving benchmark, importable by name in every Ray worker
(``aitune_testkit.serving:build``), and the artifact tuned from it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

FEATURES = 16
LENGTH = 8
"""The sequence length it is tuned for (static): another length runs eager, and says why."""
BATCH_SIZES = (2, 4)
"""The batch sizes it is tuned for: batches of 2 to 4 rows."""


class TinyEncoder(torch.nn.Module):
    """``x: [batch, length, 16]`` to ``[batch, 4]``: a projection, GELU, mean over the length, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(FEATURES, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.gelu(self.proj(x)).mean(dim=1))


class TwoHeads(TinyEncoder):
    """The same encoder answering two named outputs, ``{"logits": [batch, 4], "pooled": [batch, 32]}``,
    so a client can select one."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]  # a dict, on purpose
        pooled = torch.nn.functional.gelu(self.proj(x)).mean(dim=1)
        return {"logits": self.head(pooled), "pooled": pooled}


SLOW_S = 2.0
"""How long each call of :class:`SlowTwoHeads` takes: a request stays in flight long enough to stop
the server while it runs."""


class SlowTwoHeads(TwoHeads):
    """:class:`TwoHeads`, each call taking :data:`SLOW_S` (served ``--eager``, so it is this forward)."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]  # TwoHeads' dict
        import time

        time.sleep(SLOW_S)
        return super().forward(x)


def build_slow_two_heads() -> torch.nn.Module:
    """:class:`SlowTwoHeads`' factory."""
    return SlowTwoHeads().eval()


def build() -> torch.nn.Module:
    """The factory a deployment calls: the model freshly built, as ``ait.load`` takes it."""
    return TinyEncoder().eval()


def build_two_heads() -> torch.nn.Module:
    """:class:`TwoHeads`' factory."""
    return TwoHeads().eval()


def tune(path: str | Path, backend: str = "onnxruntime", factory: Callable[[], torch.nn.Module] = build) -> Path:
    """Tune ``factory()``'s model (:func:`build`'s by default) with one backend (no timing race: the
    first that validates wins) for batches of 2 to 4 rows of length 8, and save it to ``path``."""
    import aitune.torch as ait
    from aitune.plugins import get_manager

    model = ait.Module(
        factory(),
        "encoder",
        strategy=ait.FirstWinsStrategy([get_manager().registry.backend_class(backend)()], performance_validation=False),
    )
    g = torch.Generator().manual_seed(1)
    ait.tune(model, [torch.randn(b, LENGTH, FEATURES, generator=g) for b in BATCH_SIZES])
    ait.save(model, path)
    return Path(path)
