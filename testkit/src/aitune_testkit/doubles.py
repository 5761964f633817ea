"""Test doubles for aitune's own tests: a module that sleeps, and toy backends wrong in one known way.

:class:`SlowModule` sleeps ``delay_s`` (+ ``per_row_s`` per batch row) in every call, so the toy
backend of :mod:`aitune.testing.backends`, which scales that sleep by its ``speed``, is really
faster or slower than eager on any machine. The backends here are that toy backend with one fault:
an answer off by 10% (``toy_wrong``), a NaN (``toy_nan``), an input overwritten (``toy_mutating``),
outputs rebuilt from flat tensors as exporting backends return them (``toy_flat``), or a variant
that never applies (``toy_not_applicable``). Register them with
``register_plugin(aitune_testkit.doubles)`` next to :mod:`aitune.testing.backends`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from aitune import hookimpl, tree
from aitune.backend import BuildContext
from aitune.errors import NotApplicableError
from aitune.registry import BackendRegistry
from aitune.testing.backends import ToyBackend, register


class SlowModule(torch.nn.Module):
    """A small MLP that sleeps ``delay_s`` (+ ``per_row_s`` per batch row) in every call."""

    def __init__(self, features: int = 8, delay_s: float = 0.002, per_row_s: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(features, features)
        self.delay_s = delay_s
        self.per_row_s = per_row_s

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        delay = self.delay_s + self.per_row_s * x.shape[0]
        if delay:
            time.sleep(delay)
        y = torch.tanh(self.fc(x))
        return y if mask is None else y * mask


class WrongBackend(ToyBackend):
    """Fast, finite, and wrong by 10% of the output's scale."""

    name = "toy_wrong"

    def transform(self, output: Any, args: tuple[Any, ...]) -> Any:
        return output + 0.1 * output.abs().max()


class NaNBackend(ToyBackend):
    """Fast, and puts a NaN into the first output element."""

    name = "toy_nan"

    def transform(self, output: Any, args: tuple[Any, ...]) -> Any:
        output = output.clone()
        output.view(-1)[0] = float("nan")
        return output


class MutatingBackend(ToyBackend):
    """Fast and correct, but scribbles on its input tensor."""

    name = "toy_mutating"

    def transform(self, output: Any, args: tuple[Any, ...]) -> Any:
        args[0].mul_(0)
        return output


class FlatBackend(ToyBackend):
    """Fast and correct, and returns its outputs as exporting backends do: rebuilt from flat
    tensors by the graph's recorded output structure, so tests see that types survive it."""

    name = "toy_flat"

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        super().build(module, context)
        self.graph = context.graph

    def transform(self, output: Any, args: tuple[Any, ...]) -> Any:
        return self.graph.unflatten_outputs([t.clone() for t in tree.flatten(output)[0]])


class NotApplicableBackend(ToyBackend):
    """A variant that never applies (as an attention variant on a model with no attention): its build
    raises :class:`~aitune.errors.NotApplicableError`."""

    name = "toy_not_applicable"

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        raise NotApplicableError("the toy variant applies to no module, by design")


DOUBLES = (WrongBackend, NaNBackend, MutatingBackend, FlatBackend, NotApplicableBackend)


@hookimpl
def aitune_register_backends(registry: BackendRegistry) -> None:
    register(registry, DOUBLES, __name__)
