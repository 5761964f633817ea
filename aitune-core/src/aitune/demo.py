"""The built-in demo: a small image classifier (a CNN feature extractor and an MLP head), tuned
with every backend available on this machine, so ``aitune demo`` shows the whole flow at once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .registry import BackendRegistry


class Features(torch.nn.Module):
    """A small convolutional feature extractor: conv-bn-relu blocks and global pooling."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        channels = 3
        for out in (width, width * 2, width * 2):
            layers += [torch.nn.Conv2d(channels, out, 3, padding=1), torch.nn.BatchNorm2d(out), torch.nn.ReLU()]
            layers.append(torch.nn.MaxPool2d(2))
            channels = out
        self.body = torch.nn.Sequential(*layers)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.body(images).mean(dim=(2, 3))


class Head(torch.nn.Module):
    """An MLP classifier over the pooled features."""

    def __init__(self, features: int = 64, hidden: int = 512, classes: int = 10) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(features, hidden),
            torch.nn.GELU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.GELU(),
            torch.nn.Linear(hidden, classes),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.mlp(features)


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = Features()
        self.head = Head()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def build_model() -> Classifier:
    """The demo model freshly built (eval mode): the factory ``ait.load`` and ``aitune serve
    --factory aitune.demo:build_model`` take."""
    return Classifier().eval()


def model_and_data(batch_sizes: tuple[int, ...] = (4, 8)) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The demo model (eval mode, random weights) and a few input batches: the ``aitune tune`` factory form."""
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(b, 3, 32, 32, generator=g) for b in batch_sizes]
    return build_model(), data


def demo_backends(registry: BackendRegistry) -> list[Any]:
    """Every backend of ``registry`` that can run here, with settings suited to the demo (quantization included)."""
    from .engine.plan import default_backends

    backends = default_backends(registry, torch.device("cpu"))
    if "torchao" in registry and not registry.unavailable("torchao", torch.device("cpu")):
        backends.append(registry.backend_class("torchao")())
    return backends
