"""torchao's import notices that tell an aitune user nothing, kept out of their output.

Importing torchao tries to load every optional kernel library it ships (``_C_cutlass_90a.abi3.so``
for Hopper GPUs, ``_C_mxfp8...so``) and logs ``Failed to load <path>: ...`` at WARNING on its
``torchao`` logger for each one this machine cannot load (a CPU, another GPU): on every import,
also when transformers imports torchao. Those kernels serve GPU formats aitune's presets do not
need to have loaded, and the quantization aitune runs works without them. Its import also makes
torch log that some enums need no pytree registration (``torch.utils._pytree``).

:func:`install` (called when aitune loads this plugin) puts a filter on the ``torchao`` logger that
drops those ``Failed to load`` records unless that logger is set to DEBUG; :func:`import_torchao`
is how this backend imports torchao, with torch's pytree notices silenced for that import only.
Nothing here imports torchao before it is needed.
"""

from __future__ import annotations

import logging
import re
from types import ModuleType

_KERNEL_NOTICE = re.compile(r"Failed to load \S*torchao\S*\.so\b")


class KernelNotices(logging.Filter):
    """Drops torchao's notices about optional kernel libraries it could not load (kept at DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or not _KERNEL_NOTICE.match(record.getMessage()):
            return True
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def install() -> None:
    """Put :class:`KernelNotices` on the ``torchao`` logger, once."""
    logger = logging.getLogger("torchao")
    if not any(isinstance(f, KernelNotices) for f in logger.filters):
        logger.addFilter(KernelNotices())


def import_torchao() -> ModuleType:
    """``import torchao`` without its kernel and pytree notices (the first import is the noisy one)."""
    install()
    pytree = logging.getLogger("torch.utils._pytree")
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        import torchao
    finally:
        pytree.setLevel(level)
    return torchao
