"""Registers the onnxruntime backend with aitune; imports no runtime."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from aitune.plugin import BackendRegistrar, BackendSpec, hookimpl

CPU_DISTRIBUTIONS = ("onnxruntime",)
GPU_DISTRIBUTIONS = ("onnxruntime-gpu", "ort-nightly-gpu", "onnxruntime-training")
"""Distributions of ONNX Runtime built with the CUDA and TensorRT execution providers."""
MIN_VERSION = (1, 17)
MIN_GPU_VERSION = (1, 18)
"""The first onnxruntime-gpu whose CUDA and TensorRT providers both take ``user_compute_stream`` from Python."""
TENSORRT_LIBRARIES = tuple(
    f"{name}_10.dll" if sys.platform == "win32" else f"lib{name}.so.10"
    for name in ("nvinfer", "nvinfer_plugin", "nvonnxparser")
)
"""The TensorRT libraries ONNX Runtime's TensorRT provider links (onnxruntime-gpu is built against TensorRT 10)."""
NVINFER = TENSORRT_LIBRARIES[0]
TENSORRT_MAJOR = 10
"""The TensorRT major the TensorRT provider of onnxruntime-gpu is built against (ONNX Runtime's
requirements table lists TensorRT 10.x from 1.18 on); TensorRT 11 has ``libnvinfer.so.11``."""
TENSORRT_DISTRIBUTIONS = ("tensorrt-cu13-libs", "tensorrt-cu12-libs", "tensorrt-cu13", "tensorrt-cu12", "tensorrt")
"""pip's TensorRT, whichever one is installed: they share one ``tensorrt_libs`` folder, so one major per environment."""


def installed_runtime() -> tuple[str, str] | None:
    """The installed ONNX Runtime distribution and its version, found by metadata alone."""
    for dist in GPU_DISTRIBUTIONS + CPU_DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def runtime_unavailable() -> str | None:
    """Why ONNX Runtime cannot be used at all, or None."""
    found = installed_runtime()
    if found is None:
        return (
            "ONNX Runtime is not installed: pip install 'aitune-backend-onnxruntime[cpu]' "
            "(or '[gpu]' for the CUDA and TensorRT execution providers)"
        )
    dist, version = found
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < MIN_VERSION:
        return (
            f"{dist} {version} is installed but >= {'.'.join(map(str, MIN_VERSION))} is required: pip install -U {dist}"
        )
    return None


def runtime_cuda_major() -> int | None:
    """The CUDA major the installed ONNX Runtime is built for; None for a CPU build or when unknown.

    Read from ``onnxruntime/capi/build_and_package_info.py`` as text (its ``cuda_version``), so
    nothing of ONNX Runtime is imported or run.
    """
    try:
        spec = importlib.util.find_spec("onnxruntime")  # a top-level package: found, not imported
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        info = Path(folder) / "capi" / "build_and_package_info.py"
        if info.is_file():
            return cuda_major_of(info.read_text(encoding="utf-8", errors="replace"))
    return None


def cuda_major_of(build_info: str) -> int | None:
    """``cuda_version = '13.0'`` in ONNX Runtime's build info -> 13; None when absent or unreadable."""
    try:
        body = ast.parse(build_info).body
    except SyntaxError:
        return None
    for node in body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "cuda_version" for t in node.targets)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            head = node.value.value.split(".")[0]
            return int(head) if head.isdigit() else None
    return None


def cuda_mismatch(dist: str, version: str, ort_cuda: int | None, torch_cuda: str | None) -> str | None:
    """Why an ONNX Runtime built for another CUDA major than torch cannot run its GPU providers here."""
    torch_major = int(torch_cuda.split(".")[0]) if torch_cuda and torch_cuda.split(".")[0].isdigit() else None
    if ort_cuda is None or torch_major is None or ort_cuda == torch_major:
        return None
    return (
        f"{dist} {version} is built for CUDA {ort_cuda} and torch for CUDA {torch_major}: its CUDA provider "
        f"needs CUDA {ort_cuda}'s libraries, which torch's install does not bring, and ONNX Runtime would fall "
        f"back to the CPU; install the {dist} build for CUDA {torch_major} (onnxruntime.ai lists where each "
        f"CUDA major's build is published) or a torch built for CUDA {ort_cuda}"
    )


def provider_unavailable(provider: str) -> str | None:
    """Why the execution provider ``"cpu"``, ``"cuda"`` or ``"tensorrt"`` cannot run here, or None."""
    reason = runtime_unavailable()
    if reason or provider == "cpu":
        return reason
    import torch

    reasons = []
    if not torch.cuda.is_available():
        reasons.append("no CUDA device is visible to torch")
    dist, version = installed_runtime()  # type: ignore[misc]
    if dist not in GPU_DISTRIBUTIONS:
        reasons.append(
            f"the installed {dist} {version} is the CPU-only build (replace it: pip uninstall onnxruntime && "
            "pip install onnxruntime-gpu)"
        )
    elif tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < MIN_GPU_VERSION:
        floor = ".".join(map(str, MIN_GPU_VERSION))
        reasons.append(
            f"{dist} {version} is installed, but the GPU providers need >= {floor}: pip install -U '{dist}>={floor}'"
        )
    elif mismatch := cuda_mismatch(dist, version, runtime_cuda_major(), torch.version.cuda):
        reasons.append(mismatch)
    if not reasons and provider == "tensorrt":
        major = (torch.version.cuda or "13").split(".")[0]
        conflict = tensorrt_conflict(installed_tensorrt(), major, installed_torch_tensorrt())
        reasons.append(conflict or tensorrt_library()[1] or "")
    return "; ".join(r for r in reasons if r) or None


def installed_tensorrt() -> tuple[str, str] | None:
    """pip's TensorRT distribution and version, found by metadata alone (None when there is none)."""
    for dist in TENSORRT_DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


TORCHTRT_TENSORRT = {"2.11": "10.15", "2.12": "10.16", "2.13": "11.0"}
"""The TensorRT minor each Torch-TensorRT release requires (``tensorrt>=X,<X+0.1`` in its
``setup.py``, x86_64): only a release on TensorRT 10 can share an environment with the provider."""


def installed_torch_tensorrt() -> str | None:
    """The installed Torch-TensorRT's version, found by metadata alone (None when there is none)."""
    try:
        return importlib.metadata.version("torch-tensorrt")
    except importlib.metadata.PackageNotFoundError:
        return None


def tensorrt_conflict(
    installed: tuple[str, str] | None, cuda_major: str, torch_tensorrt: str | None = None
) -> str | None:
    """Why pip's TensorRT cannot serve the TensorRT provider: another major than it links (TensorRT 11,
    which ``aitune-backend-tensorrt[cu12]``/``[cu13]`` resolve to, beside the provider's TensorRT 10).
    ``torch_tensorrt``: the installed Torch-TensorRT, whose own TensorRT pin decides whether pinning
    TensorRT 10 is a fix at all (Torch-TensorRT 2.13, torch 2.13's, requires TensorRT 11.0)."""
    if installed is None:
        return None
    dist, version = installed
    head = version.split(".")[0]
    if not head.isdigit() or int(head) == TENSORRT_MAJOR:
        return None
    why = (
        f"{dist} {version} is TensorRT {head}, but ONNX Runtime's TensorRT provider is built against TensorRT "
        f"{TENSORRT_MAJOR} ({NVINFER}), and one environment holds one TensorRT"
    )
    pinned = TORCHTRT_TENSORRT.get(".".join((torch_tensorrt or "").split(".")[:2]))
    if torch_tensorrt is not None and (pinned is None or not pinned.startswith(f"{TENSORRT_MAJOR}.")):
        requires = f"TensorRT {pinned}" if pinned else f"a TensorRT other than {TENSORRT_MAJOR}"
        return (
            f"{why}; the installed Torch-TensorRT {torch_tensorrt} requires {requires}, so pinning TensorRT "
            f"{TENSORRT_MAJOR} would break it: here use the CUDA provider (or aitune's tensorrt backend), or "
            "run the TensorRT provider from an environment without Torch-TensorRT (or with torch 2.12 and "
            "Torch-TensorRT 2.12, whose TensorRT 10.16 serves all three); the README's GPU install section "
            "has the table"
        )
    return (
        f"{why}; pin TensorRT {TENSORRT_MAJOR} for "
        f"both (pip install 'tensorrt-cu{cuda_major}>={TENSORRT_MAJOR},<{TENSORRT_MAJOR + 1}' "
        f"'tensorrt-cu{cuda_major}-libs>={TENSORRT_MAJOR},<{TENSORRT_MAJOR + 1}', which aitune-backend-tensorrt "
        "accepts too; Torch-TensorRT 2.13 cannot then share the environment: it requires TensorRT 11.0), or use "
        "the CUDA provider or aitune's tensorrt backend here"
    )


def nvinfer_candidates() -> list[Path]:
    """Where ``NVINFER`` may be: pip's TensorRT wheels (``tensorrt_libs``, not on the loader's path), then
    the folders of ``LD_LIBRARY_PATH`` (``PATH`` on Windows); only files that exist."""
    folders: list[str] = []
    try:
        spec = importlib.util.find_spec("tensorrt_libs")  # locates the package, runs nothing
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        folders.extend(spec.submodule_search_locations)
    search = os.environ.get("PATH" if sys.platform == "win32" else "LD_LIBRARY_PATH", "")
    folders.extend(f for f in search.split(os.pathsep) if f)
    return [Path(f) / NVINFER for f in folders if (Path(f) / NVINFER).is_file()]


def _loads(library: str) -> str | None:
    """Why ``library`` does not load, asked of a child process so a crash in a native library stays there."""
    code = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
    try:
        out = subprocess.run([sys.executable, "-c", code, library], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    lines = (out.stderr or "").strip().splitlines()
    return None if out.returncode == 0 else (lines[-1] if lines else f"exit status {out.returncode}")


@functools.cache
def tensorrt_library() -> tuple[str | None, str | None]:
    """(the TensorRT library to preload, None) when it loads here, else (None, why not)."""
    tried = [str(p) for p in nvinfer_candidates()] or [NVINFER]  # the bare name: the system's loader path
    problems = []
    for library in tried:
        problem = _loads(library)
        if problem is None:
            return library, None
        problems.append(problem)
    import torch

    major = (torch.version.cuda or "13").split(".")[0]  # TensorRT's CUDA build must be torch's
    return None, (
        f"its TensorRT library {NVINFER} does not load here ({problems[-1]}); install TensorRT 10 for CUDA {major} "
        f"(pip install 'tensorrt-cu{major}-libs>=10,<11', which aitune preloads) or put TensorRT's lib folder "
        "on LD_LIBRARY_PATH"
    )


def preload_tensorrt() -> None:
    """Load TensorRT's library into this process, so the provider finds it even off the loader's path."""
    import ctypes

    library, problem = tensorrt_library()
    if library is None:
        raise OSError(problem)
    mode = getattr(ctypes, "RTLD_GLOBAL", 0)
    ctypes.CDLL(library, mode=mode)
    folder = Path(library).parent
    for name in TENSORRT_LIBRARIES[1:]:  # they link against nvinfer, loaded first; a bare name: the system's
        if (folder / name).is_file():
            ctypes.CDLL(str(folder / name), mode=mode)


def _probe(device: str) -> str | None:
    if device == "cpu":
        return provider_unavailable("cpu")
    reason = provider_unavailable("cuda")
    return f"CUDA and TensorRT execution providers unavailable: {reason}" if reason else None


@hookimpl
def aitune_register_backends(registry: BackendRegistrar) -> None:
    registry.add(
        BackendSpec(
            name="onnxruntime",
            backend_class="aitune_backend_onnxruntime.backend:ONNXRuntimeBackend",
            config_class="aitune_backend_onnxruntime.config:ONNXRuntimeBackendConfig",
            exports={"ONNXExecutionProvider": "aitune_backend_onnxruntime.config:ONNXExecutionProvider"},
            requirements=("onnx>=1.16", "onnxscript>=0.1"),
            devices=("cpu", "cuda"),
            probe=_probe,
            description=(
                "ONNX export run by ONNX Runtime (CPU, CUDA or TensorRT execution provider; "
                f"the TensorRT provider needs TensorRT {TENSORRT_MAJOR})"
            ),
        )
    )
