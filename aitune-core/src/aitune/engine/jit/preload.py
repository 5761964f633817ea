"""Importing what background tuning will need before the program serves.

A module imported for the first time by the tuner thread stalls the program's own calls: the
import holds the module's import lock (a serving thread that touches the same module waits for the
whole import) and a C extension's initialization holds the GIL. Measured on a small CNN, the tuner
thread imported 467 modules at the start of its first tune (TorchDynamo's debugging chain through
``functorch.compile``, ``torch.export``'s serializer, Inductor's code cache, every backend plugin);
calls made in that window took up to 1.4 s against eager's 3 ms p99.

So switching background JIT tuning on imports them first, on the thread that switches it on (at
interpreter start with ``AITUNE_JIT=1``): core's own list here, and each default backend's
``Backend.warm_imports``. It costs about half a second to two seconds once, logged and kept in
:data:`LAST` (``aitune.torch.jit.startup()``). ``aitune.torch.jit.config.preload = False`` leaves
them to the tuner thread.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import time
from collections.abc import Callable, Iterable

import attrs
import torch

from ...plugins import AituneManager
from ..plan import default_backends
from .settings import settings

logger = logging.getLogger("aitune")

CORE = (
    # aitune's own modules that the tuner imports on first use
    "aitune.builtin.buildcache",
    "aitune.builtin.journal",
    "aitune.builtin.operations",
    "aitune.plugin",
    "aitune.onnx_export",
    "aitune.traced_branches",
    "aitune.validation",
    "aitune.engine.tuner",
    "aitune.engine.jit.decide",
    "safetensors.torch",
    # TorchDynamo's graph-break check (torch._dynamo.explain) and what it pulls in
    "torch._dynamo.testing",
    "torch._dynamo.backends.debugging",
    "functorch.compile",
    "torch._functorch.aot_autograd",
    "torch._functorch.partitioners",
    # torch.export, which every exporting backend (ONNX Runtime's dynamo path, AOTInductor) runs
    "torch.export",
    "torch.export._trace",
    "torch.export._unlift",
    "torch._export.serde.serialize",
    "torch._export.passes",
    "torch.export.pt2_archive",
    "torch.fx.experimental.proxy_tensor",
    "torch.fx.experimental.symbolic_shapes",
    "torch.fx.passes.shape_prop",
    "torch.fx.experimental.validator",
    "torch._subclasses.schema_check_mode",
    "torch._dynamo.repro.after_dynamo",
    "torch._dynamo.dce_extra_outputs",
    "torch._export.passes._node_metadata_hook",
    "torch._export.passes.replace_autocast_with_hop_pass",
    "torch._export.passes.replace_set_grad_with_hop_pass",
    "torch._higher_order_ops.passes.inline_invoke_subgraph",
    "torch.nn.attention.flex_attention",
    "torch.distributed.tensor.experimental",
    "torch.utils.serialization",
)
"""What the tuner itself imports on first use, whatever the backends."""


@attrs.frozen
class Preloaded:
    """What switching background tuning on imported, and what it cost."""

    seconds: float
    modules: int
    """Modules newly imported (a module already imported by the program costs nothing)."""
    failed: tuple[str, ...] = ()
    """Names that could not be imported, with the error: the tuner thread will meet them again."""

    def describe(self) -> str:
        text = f"imported {self.modules} modules the tuner needs in {self.seconds:.2f} s, before serving"
        return text + (f" ({len(self.failed)} could not be: {', '.join(self.failed[:3])})" if self.failed else "")


LAST: Preloaded | None = None
"""The preload of this process, once background tuning was switched on."""


def preload(manager_source: Callable[[], AituneManager]) -> Preloaded:
    """Import :data:`CORE` and the ``warm_imports`` of every default backend on this machine's
    devices; a name that fails is noted, never raised (the tuner copes with a broken backend)."""
    global LAST
    import sys

    before, start = len(sys.modules), time.perf_counter()
    failed = [f"{name}: {problem}" for name in (*CORE, *_backend_modules(manager_source)) if (problem := _load(name))]
    LAST = Preloaded(time.perf_counter() - start, len(sys.modules) - before, tuple(failed))
    logger.info("aitune jit: %s", LAST.describe())
    return LAST


def _backend_modules(manager_source: Callable[[], AituneManager]) -> Iterable[str]:
    """Each default backend's module and its ``warm_imports``, for every device this machine has."""
    try:
        registry = manager_source().registry
    except Exception as exc:  # a broken plugin: the tuner reports it when it runs
        logger.debug("aitune jit: no backends preloaded (%s: %s)", type(exc).__name__, exc)
        return []
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    names: list[str] = []
    for device in devices:
        try:
            backends = default_backends(registry, device)
        except Exception as exc:
            logger.debug("aitune jit: no %s backends preloaded (%s: %s)", device, type(exc).__name__, exc)
            continue
        classes = [type(b) for b in backends]
        for name in settings.backends or ():  # named by the user: tried even when not a default
            with contextlib.suppress(Exception):
                classes.append(registry.backend_class(name))
        for cls in classes:
            names.extend([cls.__module__, *cls.warm_imports])
    return dict.fromkeys(names)


def _load(name: str) -> str | None:
    try:
        importlib.import_module(name)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
