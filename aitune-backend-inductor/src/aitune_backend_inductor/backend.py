"""The inductor backends (not implemented yet: building raises a clear error)."""

from __future__ import annotations

from aitune.backend import PendingBackend

from .config import TorchInductorJitBackendConfig, TorchInductorAotBackendConfig


class TorchInductorJitBackend(PendingBackend):
    """torch.compile with the inductor backend, compiled in the process."""

    name = "torch_inductor_jit"
    config_class = TorchInductorJitBackendConfig
    planned = "issue 4"


class TorchInductorAotBackend(PendingBackend):
    """torch.export + AOTInductor, a .pt2 package that loads without compiling."""

    name = "torch_inductor_aot"
    config_class = TorchInductorAotBackendConfig
    planned = "issue 4"
