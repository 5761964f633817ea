"""The CNN the example's tests tune; its own module so a fresh process can build it too."""

from __future__ import annotations

import torch


class SmallCNN(torch.nn.Module):
    """Conv -> BatchNorm -> ReLU twice, then a classifier: the shape channels-last is for."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.Conv2d(8, 16, 3, padding=1, stride=2),
            torch.nn.BatchNorm2d(16),
            torch.nn.ReLU(),
        )
        self.head = torch.nn.Linear(16, 4)
        with torch.no_grad():  # BatchNorm statistics that are not the identity, so folding shows
            for bn in (self.features[1], self.features[4]):
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)
                bn.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))
