"""The model zoo: small models with random weights, built the same way in every process.

Each case builds its model from a fixed seed, so a child process measuring cold start gets
the same weights the parent tuned. ``targets`` names the submodules to wrap (None: the whole
model is one ``ait.Module``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d: int = 256, hidden: int = 1024) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, d)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )  # fmt: skip
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class Encoder(nn.Module):
    """One ``TransformerEncoderLayer``: in eval under no_grad it takes PyTorch's fused fast path."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class GRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(64, 128, batch_first=True)
        self.head = nn.Linear(128, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class Pipeline:
    """Two modules called by plain Python, as ``ait.tune(pipeline, data)`` sees an application."""

    def __init__(self) -> None:
        self.encoder = CNN().features
        self.head = MLP(64, 256)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).flatten(1))

    def eval(self) -> Pipeline:
        self.encoder.eval()
        self.head.eval()
        return self

    def to(self, device: Any) -> Pipeline:
        self.encoder.to(device)
        self.head.to(device)
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{n}.{k}": v for n in ("encoder", "head") for k, v in getattr(self, n).state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for n in ("encoder", "head"):
            getattr(self, n).load_state_dict({k[len(n) + 1 :]: v for k, v in state.items() if k.startswith(n + ".")})


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], Any]
    input_shape: tuple[int, ...]
    """Shape of one sample, without the batch axis."""
    targets: tuple[str, ...] | None = None
    fastpath: bool = True
    """False: ``torch.backends.mha.set_fastpath_enabled(False)`` while this case runs."""
    note: str = ""

    def build(self, device: str = "cpu") -> Any:
        torch.manual_seed(0)
        return self.make().eval().to(device)

    def inputs(self, batch: int, device: str = "cpu", seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed + batch)
        return torch.randn((batch, *self.input_shape), generator=g).to(device)


CASES: dict[str, Case] = {
    c.name: c
    for c in [
        Case("mlp", MLP, (256,), note="256-1024-1024-256, GELU"),
        Case("cnn", CNN, (3, 32, 32), note="3 conv + BN + pool, 32x32"),
        Case("encoder", Encoder, (32, 128), note="TransformerEncoderLayer d=128, seq 32, fast path on"),
        Case("encoder_nofast", Encoder, (32, 128), fastpath=False, note="same layer, fast path off"),
        Case("gru", GRU, (16, 64), note="GRU 64->128, seq 16, linear head"),
        Case(
            "pipeline", Pipeline, (3, 32, 32), targets=("encoder", "head"), note="CNN features -> MLP head, 2 modules"
        ),
    ]
}

TINY = Case("tiny", lambda: nn.Linear(16, 16), (16,), note="Linear(16, 16): per-call overhead")


def get(name: str) -> Case:
    if name == TINY.name:
        return TINY
    try:
        return CASES[name]
    except KeyError:
        raise SystemExit(f"unknown case {name!r}; choose from {', '.join(CASES)}") from None


class fastpath:
    """Turn PyTorch's MHA fast path on or off for a block (a process-wide flag)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self) -> None:
        self.previous = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(self.enabled)

    def __exit__(self, *exc: object) -> None:
        torch.backends.mha.set_fastpath_enabled(self.previous)
