"""Where Inductor caches compiled code while aitune compiles: ``<aitune cache>/inductor``, the user's alone.

Inductor (and Triton under it) keeps what it compiled on disk and loads it back on a later compile:
pickled FX graphs and AOTAutograd entries, generated Python, shared libraries, Triton kernels.
Its default folder, ``/tmp/torchinductor_<user>``, has a fixed name in a folder every account may
write, so another account that makes it first decides what the next compile loads and runs. Every
compile aitune causes therefore happens with Inductor pointed at aitune's private, checked folder:

* :func:`inductor_cache` around a build or a load: checks the folder, then switches to it;
* :class:`InductorCacheSwitch` around each call of a compiled module at run time, where
  ``torch.compile`` compiles again for a shape it has not seen; it only switches (a few
  microseconds), the folder was checked when the module was built or loaded;
* :func:`inductor_options` in the options of every Inductor compile: precompiled headers off,
  because Inductor keeps them in the default folder whatever ``TORCHINDUCTOR_CACHE_DIR`` says.

Inductor reads ``TORCHINDUCTOR_CACHE_DIR`` at each use (``cache_dir()``; the FX graph, AOTAutograd
and code caches, its compile workers get it with each job), and sets ``TRITON_CACHE_DIR`` from it
once, at its first Triton kernel; so the switch sets both, for the time of aitune's own call. The
environment is the process's: a switch is shared by all threads and counted, so the variables go
back only when the last of overlapping aitune calls (the JIT's serving thread, a background
tuning thread) ends. A ``TORCHINDUCTOR_CACHE_DIR`` or ``TRITON_CACHE_DIR`` the user set stays
their choice.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_ENV = "TRITON_CACHE_DIR"

INDUCTOR_MODULES = (
    "torch._inductor.compile_fx",
    "torch._inductor.graph",
    "torch._inductor.lowering",
    "torch._inductor.decomposition",
    "torch._inductor.scheduler",
    "torch._inductor.select_algorithm",
    "torch._inductor.async_compile",
    "torch._inductor.codecache",
    "torch._inductor.codegen.cpp",
    "torch._inductor.codegen.cpp_wrapper_cpu",
    "torch._inductor.codegen.wrapper",
    "torch._inductor.codegen.wrapper_fxir",
    "torch._inductor.codegen.memory_planning",
    "torch._inductor.codegen.segmented_tree",
    "torch._inductor.codegen.cpp_wrapper_cpu_array_ref",
    "torch._inductor.codegen.cpp_wrapper_gpu",
    "torch._inductor.codegen.cuda_combined_scheduling",
    "torch._inductor.codegen.cpu_device_op_overrides",
    "torch._inductor.codegen.cuda.device_op_overrides",
    "torch._inductor.codegen.halide",
    "torch._inductor.codegen.mps",
    "torch._inductor.codegen.pallas",
    "torch._inductor.codegen.cpp_wrapper_mps",
    "torch._inductor.codegen.mps_device_op_overrides",
    "torch._inductor.codegen.python_wrapper_mtia",
    "torch._inductor.codegen.mtia.device_op_overrides",
    "torch._inductor.codegen.xpu.xpu_combined_scheduling",
    "torch._inductor.codegen.xpu.device_op_overrides",
    "torch._inductor.extern_node_serializer",
    "torch._inductor.hooks",
    "torch._inductor.fx_passes.efficient_conv_bn_eval",
    "torch._inductor.fx_passes.apply_gumbel_max_trick",
    "torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass",
    "sympy.combinatorics",
    "sympy.physics.units",
    "triton.compiler",
    "torch._inductor.kernel.mm",
    "torch._inductor.kernel.flex.flex_attention",
    "torch._inductor.fx_passes.pre_grad",
    "torch._inductor.fx_passes.joint_graph",
    "torch._inductor.fx_passes.post_grad",
    "torch._inductor.fx_passes.fuse_attention",
    "torch._inductor.fx_passes.pad_mm",
    "torch._inductor.fx_passes.freezing_patterns",
    "torch._inductor.fx_passes.mkldnn_fusion",
    "torch._inductor.runtime.caching",
    "torch._inductor.runtime.triton_heuristics",
    "torch._inductor.bounds",
    "torch._inductor.choices",
    "torch._inductor.autotune_process",
    "torch._inductor.compiler_bisector",
    "torch._dynamo.repro.after_aot",
    "torch._functorch._aot_autograd.subclass_codegen",
    "torch._functorch._aot_autograd.subclass_parametrization",
    "torch.fx.passes.fake_tensor_prop",
    "torch.utils.cpp_extension",
    "concurrent.futures.process",
    "multiprocessing.synchronize",
)
"""What an Inductor compile imports on first use (torch 2.13, CPU): the ``warm_imports`` of the
backends that compile with Inductor, so background JIT tuning imports them before the program
serves (:mod:`aitune.engine.jit.preload`)."""

PRIVATE_OPTIONS = {"cpp_cache_precompile_headers": False, "aot_inductor.precompile_headers": False}
"""Inductor options every aitune compile gets: its precompiled headers live in
``<default folder>/precompiled_headers`` (fixed when Inductor is imported, ``TORCHINDUCTOR_CACHE_DIR``
notwithstanding), and a header planted there is compiled into every kernel."""

_lock = threading.Lock()
_depth = 0
_before: dict[str, str | None] = {}  # each variable the outermost switch set, and its value before
_set: dict[str, str] = {}  # what it set them to


def default_dir() -> str:
    """Inductor's own default folder, ``<temp>/torchinductor_<user>``."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def _under(path: str, folder: str) -> bool:
    path = os.path.abspath(path)
    return path == folder or path.startswith(folder + os.sep)


def _users(var: str) -> str | None:
    """The variable as the user has it: what it was before a switch now in effect set it."""
    with _lock:
        if var in _set and os.environ.get(var) == _set[var]:
            return _before[var]
    return os.environ.get(var)


def inductor_cache_dir(cache_dir: Path) -> Path:
    """The user's own ``TORCHINDUCTOR_CACHE_DIR`` when they set one, else ``<aitune cache>/inductor``.

    Inductor writes its default folder into the environment the first time it compiles, so a value
    equal to that default counts as unset.
    """
    chosen = _users(ENV)
    if chosen and os.path.abspath(chosen) != default_dir():
        return Path(chosen)
    return Path(cache_dir) / "inductor"


def _make_private(folder: Path) -> None:
    """``<aitune cache>/inductor`` holds compiled code Inductor loads and runs: made 0700 whatever the
    umask (Inductor makes its own subfolders with the umask's mode, so this one keeps others out);
    one another user owns, others may write, or that is a link is moved aside and made again."""
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    if not hasattr(os, "getuid"):  # no POSIX owners: the folder's ACL decides
        return
    info = os.lstat(folder)
    if not stat.S_ISLNK(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022:
        if info.st_mode & 0o077:  # readable by others (an older aitune, umask 022): nothing planted, close it
            folder.chmod(0o700)
        return
    warnings.warn(
        f"Inductor's cache {folder} is not yours alone (mode {stat.S_IMODE(info.st_mode):o}, owner {info.st_uid}); "
        "what is cached there runs when used, so it was removed and starts empty",
        RuntimeWarning,
        stacklevel=4,
    )
    aside = folder.with_name(f".evicted-{folder.name}-{os.getpid()}")
    os.rename(folder, aside)
    shutil.rmtree(aside, ignore_errors=True)
    folder.mkdir(mode=0o700)


def _switch_on(inductor: str, triton: str) -> None:
    global _depth
    with _lock:
        if _depth == 0:
            _before.clear()
            _set.clear()
            env = os.environ
            now = env.get(ENV)
            if now != inductor:
                _before[ENV], _set[ENV], env[ENV] = now, inductor, inductor
            now = env.get(TRITON_ENV)
            # unset, or what Inductor derived from its default folder: Inductor would use (or set) that
            if now != triton and (now is None or _under(now, default_dir())):
                _before[TRITON_ENV], _set[TRITON_ENV], env[TRITON_ENV] = now, triton, triton
        _depth += 1


def _switch_off() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth:
            return
        env = os.environ
        for var, value in _set.items():
            if env.get(var) != value:
                continue  # changed meanwhile (by the user): theirs now
            before = _before[var]
            if before is None:
                env.pop(var, None)
            else:
                env[var] = before
        _set.clear()
        _before.clear()


class InductorCacheSwitch:
    """Inductor (and Triton) pointed at ``folder`` for a ``with`` block: cheap enough for every call.

    Reusable and shared by threads; overlapping blocks (nested, or in several threads) are counted,
    and the first keeps its folder until the last ends. The folder is not checked here: take it
    from :func:`inductor_cache`, which checked it.
    """

    __slots__ = ("_inductor", "_triton", "folder")

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._inductor = os.path.abspath(self.folder)
        self._triton = os.path.join(self._inductor, "triton", "0")  # where Inductor itself would put it

    def __enter__(self) -> Path:
        _switch_on(self._inductor, self._triton)
        return self.folder

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        _switch_off()

    def __repr__(self) -> str:
        return f"InductorCacheSwitch({str(self.folder)!r})"


@contextlib.contextmanager
def inductor_cache(cache_dir: Path) -> Iterator[Path]:
    """Inductor and Triton pointed at :func:`inductor_cache_dir` for a block, that folder checked first
    (aitune's own is made private; one that is not the user's alone is emptied, with a warning)."""
    folder = inductor_cache_dir(cache_dir)
    if folder == Path(cache_dir) / "inductor":
        _make_private(folder)
    else:  # the user's own TORCHINDUCTOR_CACHE_DIR: their choice
        folder.mkdir(parents=True, exist_ok=True)
    with InductorCacheSwitch(folder):
        yield folder


def inductor_options(
    options: dict[str, Any] | None = None, mode: str | None = None, dynamic: bool | None = None
) -> dict[str, Any]:
    """``torch.compile``'s ``options`` for an aitune compile: ``mode``'s preset (as torch.compile
    expands it), then ``options``, then :data:`PRIVATE_OPTIONS` (those this torch knows). Pass the
    result as ``options=`` and no ``mode`` (torch.compile takes one of them)."""
    import torch._inductor
    import torch._inductor.config as config

    merged: dict[str, Any] = {}
    if mode and mode != "default":
        merged.update(torch._inductor.list_mode_options(mode, dynamic))
    merged.update(options or {})
    known = config.get_config_copy()
    merged.update({k: v for k, v in PRIVATE_OPTIONS.items() if k in known})
    return merged
