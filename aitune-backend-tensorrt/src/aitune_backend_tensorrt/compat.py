"""Can TensorRT run here, and can this machine run a saved plan? Answered without loading TensorRT.

TensorRT's native libraries (its lean runtime above all) can crash the process when no NVIDIA
driver is present, so nothing here imports ``tensorrt``: the installed version comes from package
metadata, the GPU from torch, and the one fallback that must import TensorRT runs in a subprocess.
A plan is tied to the TensorRT version and the GPU's compute capability it was built for, so
``load`` compares the saved facts with this machine before TensorRT ever parses the plan.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import attrs

from aitune.plugin import ArtifactError, BackendUnavailableError

INSTALL_HINT = "pip install 'aitune-backend-tensorrt[runtime,cu13]'"
"""For PyPI's torch (CUDA 13 since 2.11); :func:`install_hint` names the extra for the torch installed."""
MIN_MAJOR = 10
MAX_MAJOR = 11
"""TensorRT majors whose Python API this backend speaks (11 dropped the weak-typing precision flags)."""
MODELOPT = "nvidia-modelopt"
MIN_MODELOPT = (0, 44)
"""AutoCast reads a folder of .npz files from 0.43; ``quantize(calibration_data_reader=...)`` exists from 0.44."""
TENSORRT_DISTRIBUTIONS = (
    "tensorrt",
    "tensorrt-cu13",
    "tensorrt-cu12",
    "tensorrt-cu11",
    "tensorrt-cu13-bindings",
    "tensorrt-cu12-bindings",
)
"""Distributions that ship the full ``tensorrt`` Python module (pip wheels, NGC containers)."""


FRONTENDS = ("tensorrt-cu13", "tensorrt-cu12", "tensorrt-cu11")
"""Distributions that each write the whole ``tensorrt`` package: two of them installed overwrite each other."""


def install_hint(torch_cuda: int | None = None) -> str:
    """The pip line that installs TensorRT for torch's CUDA major (CUDA 13 when torch has none)."""
    major = torch_cuda if torch_cuda is not None else torch_cuda_major()
    return f"pip install 'aitune-backend-tensorrt[runtime,cu{major if major in (12, 13) else 13}]'"


def installed_frontends() -> list[str]:
    """The TensorRT frontend distributions installed (``tensorrt-cu12``...), from metadata."""
    found = []
    for dist in FRONTENDS:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(dist)
    return found


def installed_tensorrt() -> tuple[bool, str | None]:
    """(installed, version) from package metadata; a module found without metadata has version None."""
    for dist in TENSORRT_DISTRIBUTIONS:
        try:
            return True, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        found = importlib.util.find_spec("tensorrt") is not None  # locates, does not execute
    except (ImportError, ValueError):
        found = False
    return found, None


def tensorrt_version_in_subprocess() -> str | None:
    """The version ``import tensorrt`` reports, asked of a child process so a crash stays there."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import tensorrt; print(tensorrt.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


def version_tuple(version: str) -> tuple[int, ...]:
    """``"10.9.0.34"`` -> ``(10, 9, 0)``: the part of a TensorRT version a plan depends on."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def tensorrt_cuda_major() -> int | None:
    """The CUDA major the installed TensorRT wheel is built for (``tensorrt-cu12`` -> 12), from metadata."""
    for dist in TENSORRT_DISTRIBUTIONS:
        digits = dist.removeprefix("tensorrt-cu").removesuffix("-bindings")
        if digits.isdigit():
            try:
                importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
            return int(digits)
    return None


def torch_cuda_major() -> int | None:
    """The CUDA major torch was built with; None for a CPU build."""
    import torch

    cuda = torch.version.cuda
    return int(cuda.split(".")[0]) if cuda else None


def version_reason(version: str | None, trt_cuda: int | None, torch_cuda: int | None) -> str | None:
    """Why this TensorRT release cannot serve here: a major outside 10..11, or another CUDA major than torch's."""
    if version is not None:
        major = version_tuple(version)[:1]
        if major < (MIN_MAJOR,):
            return (
                f"TensorRT {version} is installed, but this backend needs TensorRT >= {MIN_MAJOR}; upgrade it: "
                f"{install_hint(torch_cuda)}"
            )
        if major > (MAX_MAJOR,):
            return (
                f"TensorRT {version} is installed, but this backend is tested with TensorRT {MIN_MAJOR}.x to "
                f"{MAX_MAJOR}.x only; install one: pip install "
                f"'tensorrt-cu{torch_cuda or trt_cuda or 13}>={MIN_MAJOR},<{MAX_MAJOR + 1}'"
            )
    if trt_cuda is not None and torch_cuda is not None and trt_cuda != torch_cuda:
        return (
            f"the installed TensorRT is the CUDA {trt_cuda} build (tensorrt-cu{trt_cuda}), but torch is built for "
            f"CUDA {torch_cuda}: the two cannot share a process; pip uninstall tensorrt tensorrt-cu{trt_cuda} "
            f"tensorrt-cu{trt_cuda}-libs tensorrt-cu{trt_cuda}-bindings && pip install 'tensorrt-cu{torch_cuda}>={MIN_MAJOR},<{MAX_MAJOR + 1}'"
        )
    return None


def modelopt_reason(version: str | None) -> str | None:
    """Why the installed ModelOpt is too old for AutoCast and quantization here; None when absent or new enough."""
    if version is None:
        return None
    release = version_tuple(version)
    if release[:2] < MIN_MODELOPT:
        floor = ".".join(map(str, MIN_MODELOPT))
        return (
            f"{MODELOPT} {version} is installed, but ONNX AutoCast and quantization need {MODELOPT} >= {floor} "
            f"(calibration folders and calibration_data_reader); upgrade it: pip install -U '{MODELOPT}>={floor}'"
        )
    return None


def installed_modelopt() -> str | None:
    try:
        return importlib.metadata.version(MODELOPT)
    except importlib.metadata.PackageNotFoundError:
        return None


def runtime_reason() -> str | None:
    """Why TensorRT (or the installed ModelOpt) is missing, too old, too new or built for another CUDA here, or None."""
    found, version = installed_tensorrt()
    torch_cuda = torch_cuda_major()
    if not found:
        return (
            f"TensorRT is not installed (no tensorrt distribution found); install it with: {install_hint(torch_cuda)}"
        )
    frontends = installed_frontends()
    if len(frontends) > 1:
        keep = f"tensorrt-cu{torch_cuda}" if torch_cuda else "the one for your CUDA"
        return (
            f"{' and '.join(frontends)} are both installed and write one `tensorrt` package, so which one imports "
            f"is an accident; keep {keep} (torch's CUDA) and pip uninstall the other"
        )
    return version_reason(version, tensorrt_cuda_major(), torch_cuda) or modelopt_reason(installed_modelopt())


def cuda_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch (TensorRT engines run only on NVIDIA GPUs)"
    return None


def availability_reason(device: str) -> str | None:
    """Everything that stops this backend on ``device``, joined; None when it can run."""
    if device != "cuda":
        return f"TensorRT runs on CUDA devices only, not {device!r}"
    reasons = [r for r in (runtime_reason(), cuda_reason()) if r]
    return "; ".join(reasons) or None


@attrs.frozen
class Machine:
    """The facts about a machine that decide whether a plan can run on it."""

    tensorrt_version: str | None
    cuda: bool
    gpu_name: str | None = None
    compute_capability: tuple[int, int] | None = None


@functools.lru_cache(maxsize=1)
def _importable_version() -> str | None:
    return tensorrt_version_in_subprocess()


def this_machine(device_index: int | None = None) -> Machine:
    """The facts a saved plan is checked against. TensorRT's version is the one ``import tensorrt``
    reports (asked once, of a child process): the very ``trt.__version__`` a build records, whichever
    distribution's files the package holds; package metadata only when that child cannot say."""
    import torch

    found, version = installed_tensorrt()
    if found:
        version = _importable_version() or version
    if not torch.cuda.is_available():
        return Machine(tensorrt_version=version, cuda=False)
    index = torch.cuda.current_device() if device_index is None else device_index
    return Machine(
        tensorrt_version=version,
        cuda=True,
        gpu_name=torch.cuda.get_device_name(index),
        compute_capability=tuple(torch.cuda.get_device_capability(index)),  # type: ignore[arg-type]
    )


def check_compatible(saved: Mapping[str, Any], here: Machine) -> None:
    """Raise when the plan described by ``saved`` cannot run on ``here``; return when it can.

    :class:`BackendUnavailableError` when this machine lacks CUDA or TensorRT (nothing to fix in
    the artifact); :class:`ArtifactError` when the plan was built for another TensorRT or GPU.
    """
    built_with = str(saved.get("tensorrt_version", ""))
    built_cc = tuple(saved.get("compute_capability") or ())
    gpu = saved.get("gpu_name") or "an unknown GPU"
    if not here.cuda:
        raise BackendUnavailableError(
            f"this TensorRT plan was built for {gpu} (compute capability {_cc(built_cc)}), but no CUDA device is "
            "visible here; load the artifact on a machine with an NVIDIA GPU"
        )
    if here.tensorrt_version is None:
        raise BackendUnavailableError(
            f"this TensorRT plan needs TensorRT {built_with}, which is not installed here; install it: {install_hint()}"
        )
    saved_v, here_v = version_tuple(built_with), version_tuple(here.tensorrt_version)
    rebuild = "re-run ait.tune on this machine to rebuild the engine"
    if saved_v[:1] != here_v[:1]:
        raise ArtifactError(
            f"this TensorRT plan was built with TensorRT {built_with}, but TensorRT {here.tensorrt_version} is "
            f"installed here; plans do not cross major versions: install TensorRT {built_with} or {rebuild}"
        )
    if saved.get("version_compatible"):
        if here_v < saved_v:
            raise ArtifactError(
                f"this version-compatible TensorRT plan was built with TensorRT {built_with} and needs that release "
                f"or a later {saved_v[0]}.x, but {here.tensorrt_version} is installed here; upgrade TensorRT or {rebuild}"
            )
    elif here_v != saved_v:
        raise ArtifactError(
            f"this TensorRT plan was built with TensorRT {built_with} and runs only on that release, but "
            f"{here.tensorrt_version} is installed here; install TensorRT {built_with}, or {rebuild} "
            "(or build with version_compatible=True)"
        )
    here_cc = here.compute_capability or ()
    if saved.get("hardware_compatible"):
        if here_cc < (8, 0):
            raise ArtifactError(
                f"this hardware-compatible TensorRT plan needs an Ampere or newer GPU (compute capability >= 8.0), "
                f"but {here.gpu_name} has {_cc(here_cc)}; {rebuild}"
            )
    elif here_cc != built_cc:
        raise ArtifactError(
            f"this TensorRT plan was built for {gpu} (compute capability {_cc(built_cc)}), but {here.gpu_name} here "
            f"has compute capability {_cc(here_cc)}; {rebuild} (or build with hardware_compatible=True)"
        )


def _cc(cc: tuple[int, ...]) -> str:
    return ".".join(str(c) for c in cc) if cc else "unknown"
