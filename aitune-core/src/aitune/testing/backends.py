"""A toy backend with a scripted speed, for testing strategies, validation and failure handling.

:class:`ToyBackend` runs a copy of the module with the sleep of every submodule that has a
``delay_s`` (and ``per_row_s``) attribute scaled by ``config.speed``: a backend that drops the
sleep is really faster and one that doubles it is really slower, whatever the machine. Register it
with the ``toy_backends`` fixture of :mod:`aitune.testing.fixtures`, or
``register_plugin(aitune.testing.backends)``; :func:`register` declares subclasses of it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import attrs
import torch

from .. import hookimpl
from ..backend import Backend, BackendConfig, BuildContext, LoadContext
from ..registry import BackendRegistry, BackendSpec


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
            for name in ("delay_s", "per_row_s"):
                if name in vars(sub):  # its own: a wrapper forwarding to the module it wraps is skipped
                    setattr(sub, name, vars(sub)[name] * self.config.speed)
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


TOY_BACKENDS = (ToyBackend,)


def register(
    registry: BackendRegistry, classes: tuple[type[ToyBackend], ...], module: str, *, default_candidate: bool = False
) -> None:
    """Declare test backends that share :class:`ToyConfig`; default candidates (tried by a tune whose
    strategy lists no backends) only when ``default_candidate``."""
    for cls in classes:
        registry.add(
            BackendSpec(
                name=cls.name,
                backend_class=f"{module}:{cls.__name__}",
                config_class=f"{__name__}:ToyConfig",
                devices=("cpu", "cuda"),
                default_candidate=default_candidate,
            )
        )


@hookimpl
def aitune_register_backends(registry: BackendRegistry) -> None:
    register(registry, TOY_BACKENDS, __name__)
