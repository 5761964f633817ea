"""Whether the installed torch-tensorrt can run with the installed torch, from package metadata only.

Each Torch-TensorRT release is built against one torch minor version (torch-tensorrt 2.X needs
torch 2.X.*); any other pairing fails at import with an undefined-symbol error deep in a native
library. Reading installed versions needs no import, so ``aitune backends`` can say what is wrong
without loading TensorRT. The same facts pick the compile settings a release understands
(:func:`~aitune_backend_torchtrt.config.to_torch_tensorrt_kwargs`).
"""

from __future__ import annotations

import importlib.metadata

from packaging.version import InvalidVersion, Version

RUNTIME = "torch-tensorrt"
TESTED = ((2, 8), (2, 14))
"""The torch minors (and so Torch-TensorRT releases) this backend speaks: 2.8 is the first torch whose
``.pt2`` archive layout aitune's archive check reads; the pyproject has one extra per minor."""
EXPLICIT_TYPING_DEFAULT_FROM = (2, 10)
"""From 2.10 to 2.12 ``use_explicit_typing`` defaults to True, which skips the FP16/BF16 builder
flags: a config asking for lower precision must pass False there, or it builds fp32 silently."""
STRONGLY_TYPED_FROM = (2, 13)
"""From 2.13 every engine is strongly typed: ``enabled_precisions``, ``use_explicit_typing`` and
``use_python_runtime`` are gone and lower precision comes from Torch-TensorRT's autocast."""


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def minor(version: str) -> tuple[int, int]:
    """``"2.13.0+cu128"`` -> ``(2, 13)``."""
    release = Version(version).release
    return release[0], release[1] if len(release) > 1 else 0


def install_hint(torch_version: str | None = None) -> str:
    """The one-line install of the Torch-TensorRT release built for this torch (its extra pins the pair)."""
    torch_version = torch_version or installed_version("torch")
    try:
        major, mnr = minor(torch_version) if torch_version else TESTED[1]
    except InvalidVersion:
        major, mnr = TESTED[1]
    if not TESTED[0] <= (major, mnr) <= TESTED[1]:
        major, mnr = TESTED[1]
    return f"pip install 'aitune-backend-torchtrt[torch{major}{mnr}]'"


def coupling_problem(torch_tensorrt_version: str, torch_version: str) -> str | None:
    """Why this torch-tensorrt cannot run with this torch, or None when the pair matches and is tested."""
    try:
        trt, torch = Version(torch_tensorrt_version), Version(torch_version)
    except InvalidVersion as exc:
        return f"cannot compare torch-tensorrt {torch_tensorrt_version} with torch {torch_version}: {exc}"
    lo, hi = (".".join(map(str, v)) for v in TESTED)
    if not TESTED[0] <= minor(torch_version) <= TESTED[1]:
        old = minor(torch_version) < TESTED[0]
        why = "; older torch releases write a .pt2 layout aitune's archive check does not read" if old else ""
        return (
            f"torch {torch.public} is outside the torch releases this backend is tested with ({lo} to {hi}{why}); "
            f"install torch {hi} with {install_hint(hi)}"
        )
    if trt.release[:2] == torch.release[:2]:
        return None
    major, mnr = trt.release[:2]
    return (
        f"torch-tensorrt {trt.public} needs torch {major}.{mnr}.x, found {torch.public}; "
        f"install the torch-tensorrt release built for this torch "
        f"(pip install 'torch-tensorrt=={torch.release[0]}.{torch.release[1]}.*', or {install_hint(torch_version)}) "
        f"or torch {major}.{mnr}"
    )


def runtime_problem() -> str | None:
    """Why Torch-TensorRT cannot be used here (missing, untested, or built for another torch), or None."""
    torch = installed_version("torch")
    trt = installed_version(RUNTIME)
    if trt is None:
        return f"{RUNTIME} is not installed; install it with: {install_hint(torch)}"
    if torch is None:
        return f"torch is not installed, and {RUNTIME} {trt} needs it"
    return coupling_problem(trt, torch)
