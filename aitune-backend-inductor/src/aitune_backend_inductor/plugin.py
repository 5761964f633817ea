"""Registers the inductor backends with aitune; imports no runtime (not even torch._inductor)."""

from __future__ import annotations

import os
import shutil
import sys

from aitune.plugin import BackendRegistrar, BackendSpec, hookimpl, module_importable


def _cxx() -> str:
    """The C++ compiler Inductor looks for: ``$CXX``, else its platform default."""
    return os.environ.get("CXX") or (
        "clang++" if sys.platform == "darwin" else "cl" if sys.platform == "win32" else "g++"
    )


def _probe(device: str) -> str | None:
    """Inductor writes C++ (CPU kernels, AOT wrappers) and Triton (CUDA kernels) and compiles them."""
    cxx = _cxx()
    if shutil.which(cxx) is None:
        return f"Inductor compiles generated C++ and the compiler {cxx!r} is not on PATH; install one (e.g. g++) or set CXX"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device is visible to torch"
        if not module_importable("triton"):
            return "Inductor generates CUDA kernels with Triton, which is not installed (pip install triton)"
    return None


@hookimpl
def aitune_register_backends(registry: BackendRegistrar) -> None:
    registry.add(
        BackendSpec(
            name="torch_inductor_jit",
            backend_class="aitune_backend_inductor.jit:TorchInductorJitBackend",
            config_class="aitune_backend_inductor.config:TorchInductorJitBackendConfig",
            requirements=(),
            devices=("cpu", "cuda"),
            probe=_probe,
            description="torch.compile with the inductor backend, compiled and warmed up in the process",
        )
    )
    registry.add(
        BackendSpec(
            name="torch_inductor_aot",
            backend_class="aitune_backend_inductor.aot:TorchInductorAotBackend",
            config_class="aitune_backend_inductor.config:TorchInductorAotBackendConfig",
            requirements=(),
            devices=("cpu", "cuda"),
            probe=_probe,
            description="torch.export + AOTInductor, a .pt2 package that loads without compiling",
        )
    )
