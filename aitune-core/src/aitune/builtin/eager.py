"""TorchEagerBackend: the module as it is, the baseline every candidate must beat."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch

from .. import hookimpl
from ..backend import Backend, BackendConfig, BuildContext, LoadContext
from ..registry import BackendRegistrar, BackendSpec


@attrs.frozen(kw_only=True)
class TorchEagerBackendConfig(BackendConfig):
    """The eager backend has nothing to configure."""


class TorchEagerBackend(Backend):
    """Runs the original module; the baseline and the fallback."""

    name = "torch_eager"
    config_class = TorchEagerBackendConfig
    mutates_inputs = True

    def __init__(self, config: TorchEagerBackendConfig | None = None) -> None:
        super().__init__(config)
        self._module: torch.nn.Module | None = None

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        self._module = module

    def follows_weights(self) -> bool:
        return True

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        assert self._module is not None, "TorchEagerBackend used before build()"
        return self._module(*args, **kwargs)

    def save(self, directory: Path) -> dict[str, Any]:
        return {}  # the artifact carries the module's weights for every module already

    def load(self, module: torch.nn.Module, directory: Path, context: LoadContext) -> None:
        self._module = module


@hookimpl
def aitune_register_backends(registry: BackendRegistrar) -> None:
    registry.add(
        BackendSpec(
            backend_class="aitune.builtin.eager:TorchEagerBackend",
            description="the module as it is (baseline and fallback)",
        )
    )
