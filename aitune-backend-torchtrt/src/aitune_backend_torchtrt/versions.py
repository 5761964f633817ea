"""Whether the installed torch-tensorrt can run with the installed torch, from package metadata only.

Each Torch-TensorRT release is built against one torch minor version (torch-tensorrt 2.X needs
torch 2.X.*); any other pairing fails at import with an undefined-symbol error deep in a native
library. Reading installed versions needs no import, so ``aitune backends`` can say what is wrong
without loading TensorRT.
"""

from __future__ import annotations

import importlib.metadata

from packaging.version import InvalidVersion, Version

RUNTIME = "torch-tensorrt"
INSTALL_HINT = "pip install 'aitune-backend-torchtrt[runtime]'"


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def coupling_problem(torch_tensorrt_version: str, torch_version: str) -> str | None:
    """Why this torch-tensorrt cannot run with this torch, or None when the pair matches."""
    try:
        trt, torch = Version(torch_tensorrt_version), Version(torch_version)
    except InvalidVersion as exc:
        return f"cannot compare torch-tensorrt {torch_tensorrt_version} with torch {torch_version}: {exc}"
    if trt.release[:2] == torch.release[:2]:
        return None
    major, minor = trt.release[:2]
    return (
        f"torch-tensorrt {trt.public} needs torch {major}.{minor}.x, found {torch.public}; "
        f"install the torch-tensorrt release built for this torch "
        f"(pip install 'torch-tensorrt=={torch.release[0]}.{torch.release[1]}.*') or torch {major}.{minor}"
    )


def runtime_problem() -> str | None:
    """Why Torch-TensorRT cannot be used here (missing, or built for another torch), or None."""
    trt = installed_version(RUNTIME)
    if trt is None:
        return f"{RUNTIME} is not installed; install it with: {INSTALL_HINT}"
    torch = installed_version("torch")
    if torch is None:
        return f"torch is not installed, and {RUNTIME} {trt} needs it"
    return coupling_problem(trt, torch)
