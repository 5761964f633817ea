"""One program trace at a time, and no module call of the program while it runs.

``torch.export`` (non-strict, its default) and FX tracing replace ``torch.nn.Module.__call__``
for the whole process while they trace, so a module called from another thread at that moment
is traced too (and fails, or lands in the graph). Backends hold :func:`exclusive` around such a
trace (core's ONNX export does), and JIT background mode holds the same lock around each of the
program's top-level module calls while its tuner runs, so the two never overlap: a call waits
for at most one trace, never for a build or a whole tune.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

LOCK = threading.RLock()


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """Hold while tracing the user's module (``torch.export.export``, ``torch.onnx.export``, FX)."""
    with LOCK:
        yield
