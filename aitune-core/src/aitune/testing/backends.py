"""Toy backends with known behaviour, for testing strategies, validation and failure handling.

They work on modules with a ``delay_s`` attribute (see :class:`SlowModule`): eager sleeps that
long per call, so a backend that drops the sleep is really faster and one that doubles it is
really slower, whatever the machine. Register them with ``register_plugin(aitune.testing.backends)``.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from .. import hookimpl
from ..backend import Backend, BackendConfig, BuildContext, LoadContext
from ..errors import NotApplicableError
from ..registry import BackendRegistry, BackendSpec


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


@attrs.frozen(kw_only=True)
class ToyConfig(BackendConfig):
    """``speed`` scales the module's sleep (0 drops it); ``max_batch`` makes larger calls raise."""

    speed: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    max_batch: int | None = None
    fail_build: bool = False


class ToyBackend(Backend):
    """Runs a copy of the module with its sleep scaled by ``config.speed``."""

    name = "toy"
    config_class = ToyConfig
    config: ToyConfig

    def __init__(self, config: ToyConfig | None = None) -> None:
        super().__init__(config)
        self.module: torch.nn.Module | None = None
        self.calls = 0

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        if self.config.fail_build:
            raise RuntimeError("toy compiler crashed on purpose")
        self.module = copy.deepcopy(module)
        for sub in self.module.modules():
            if isinstance(sub, SlowModule):
                sub.delay_s *= self.config.speed
                sub.per_row_s *= self.config.speed
        self.build_info["built_for"] = context.graph.key

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        assert self.module is not None, "ToyBackend used before build"
        batch = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() else 1
        if self.config.max_batch is not None and batch > self.config.max_batch:
            raise RuntimeError(f"toy backend supports batch <= {self.config.max_batch}, got {batch}")
        self.calls += 1
        return self.transform(self.module(*args, **kwargs), args)

    def transform(self, output: Any, args: tuple[Any, ...]) -> Any:
        return output

    def save(self, directory: Path) -> dict[str, Any]:
        (directory / "toy.txt").write_text(str(self.config.speed))
        return {"speed": self.config.speed}

    def load(self, module: torch.nn.Module, directory: Path, context: LoadContext) -> None:
        assert (directory / "toy.txt").read_text() == str(context.metadata["speed"])
        self.build(module, BuildContext(context.graph, [], context.device, directory, context.cache_dir))


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
        from .. import tree

        return self.graph.unflatten_outputs([t.clone() for t in tree.flatten(output)[0]])


class NotApplicableBackend(ToyBackend):
    """A variant that never applies (as an attention variant on a model with no attention): its build
    raises :class:`~aitune.errors.NotApplicableError`."""

    name = "toy_not_applicable"

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        raise NotApplicableError("the toy variant applies to no module, by design")


TOY_BACKENDS = (ToyBackend, WrongBackend, NaNBackend, MutatingBackend, FlatBackend, NotApplicableBackend)


def register(registry: BackendRegistry, classes: tuple[type[ToyBackend], ...], module: str) -> None:
    """Declare test backends that share :class:`ToyConfig`; never default candidates."""
    for cls in classes:
        registry.add(
            BackendSpec(
                name=cls.name,
                backend_class=f"{module}:{cls.__name__}",
                config_class=f"{__name__}:ToyConfig",
                devices=("cpu", "cuda"),
                default_candidate=False,
            )
        )


@hookimpl
def aitune_register_backends(registry: BackendRegistry) -> None:
    register(registry, TOY_BACKENDS, __name__)
