"""Opening an AOTInductor ``.pt2`` package without compiling and without unpickling.

``torch._inductor.aoti_load_package`` goes through ``load_pt2``, which would ``torch.load``
(full unpickling, weights_only turned off) any exported program or pickled weight a package carries, and
which compiles a small C++ probe to detect the CPU's vector ISA. aitune instead checks the archive's
entries against what an AOTInductor-only package holds, checks the package was compiled for this
platform, CPU and GPU from its JSON metadata, and hands it straight to the C++ package loader,
which extracts the compiled shared library and loads it.
"""

from __future__ import annotations

import platform
import sys
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from aitune.plugin import SerializationError

MODEL = "model"
"""The model name ``aoti_compile_and_package`` gives the one model it packages."""
_ALLOWED_FILES = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}
_ALLOWED_PREFIX = "data/aotinductor/"
_LIBRARY_SUFFIXES = (".so", ".dylib", ".dll")


def check_archive(path: Path) -> str:
    """Refuse anything but an AOTInductor package with a compiled library; return the library's name.

    A package that holds only C++ sources would be compiled by the loader, and exported programs,
    weights or constants outside ``data/aotinductor/`` could be pickles: both are refused.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile) as exc:
        raise SerializationError(f"{path.name} is not a readable .pt2 package ({exc}); rebuild the artifact") from None
    libraries = []
    for name in names:
        parts = PurePosixPath(name).parts
        if name.startswith("/") or "\\" in name or ".." in parts or len(parts) < 2:
            raise SerializationError(f"{path.name} holds the entry {name!r}, which escapes the package; refusing it")
        inner = "/".join(parts[1:])  # entries sit under one folder named after the archive
        if not (inner in _ALLOWED_FILES or inner.startswith(_ALLOWED_PREFIX)):
            raise SerializationError(
                f"{path.name} holds {name!r}, which an AOTInductor package built by aitune never contains "
                "(exported programs and pickled weights are not loaded); refusing it. Rebuild the artifact"
            )
        if inner.startswith(f"{_ALLOWED_PREFIX}{MODEL}/") and inner.endswith(_LIBRARY_SUFFIXES):
            libraries.append(PurePosixPath(name).name)
    if not libraries:
        raise SerializationError(
            f"{path.name} holds no compiled library for {MODEL!r} (a C++-only package would be compiled on "
            "load); rebuild it without aot_inductor.package_cpp_only"
        )
    return libraries[0]


def compatibility_problem(metadata: dict[str, str], device: torch.device) -> str | None:
    """Why a package compiled for ``metadata``'s machine cannot run on this one, or None."""
    want = {"AOTI_PLATFORM": sys.platform, "AOTI_MACHINE": platform.machine(), "AOTI_DEVICE_KEY": device.type}
    for key, here in want.items():
        built = metadata.get(key)
        if built and built != here:
            return f"it was compiled for {key.removeprefix('AOTI_').lower()} {built!r}, this is {here!r}"
    if device.type == "cpu":
        isa = (metadata.get("AOTI_CPU_ISA") or "").split()
        have = torch.backends.cpu.get_cpu_capability()
        needs = {"AVX512": ("AVX512",), "AVX2": ("AVX2", "AVX512")}.get(isa[0] if isa else "")
        if needs is not None and have not in needs:
            return f"its kernels use {isa[0]} instructions and this CPU runs {have}"
    if device.type == "cuda" and metadata.get("AOTI_COMPUTE_CAPABILITY") and torch.version.hip is None:
        major, minor = torch.cuda.get_device_capability(device)
        here = str(major * 10 + minor)
        if metadata["AOTI_COMPUTE_CAPABILITY"] != here:
            return f"its kernels were compiled for compute capability {metadata['AOTI_COMPUTE_CAPABILITY']}, this GPU is {here}"
    return None


def open_package(path: Path, device: torch.device) -> tuple[Any, dict[str, str], str]:
    """Load ``path`` on ``device``: the C++ loader, the package's metadata and its library's name."""
    library = check_archive(path)
    loader_class = torch._C._aoti.AOTIModelPackageLoader
    try:
        metadata = dict(loader_class.load_metadata_from_package(str(path), MODEL))  # type: ignore[attr-defined]
    except RuntimeError as exc:
        raise SerializationError(f"cannot read the metadata of {path.name}: {exc}") from None
    problem = compatibility_problem(metadata, device)
    if problem:
        raise SerializationError(f"{path.name} cannot run here: {problem}; rebuild the artifact on this machine")
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
    else:
        index = -1  # the loader refuses an index for CPU
    try:
        loader = loader_class(str(path), MODEL, False, 1, index)
    except RuntimeError as exc:
        raise SerializationError(f"the AOTInductor loader refused {path.name}: {exc}") from None
    return loader, metadata, library
