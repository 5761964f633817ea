"""What a tracer prints while aitune traces the user's module, kept out of the user's terminal.

``torch.export`` prints the partial graph of a trace that met data-dependent code to stderr
(hundreds of lines for a transformer, once for each way the ONNX exporter tries), and exporters
print progress to stdout. aitune says in its own words why an export failed, so :func:`captured`
takes what the calling thread prints for the length of one trace and logs it at DEBUG on aitune's
logger (``logging.getLogger("aitune").setLevel(logging.DEBUG)`` with a handler shows it).

Other threads keep their output (the progress line, a serving thread, the user's own): while any
capture is open, ``sys.stdout`` and ``sys.stderr`` are streams that send a capturing thread's
writes to its capture and every other write on to the stream they replaced, which is put back
when the last capture closes. What native code writes to the file descriptors is not captured.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

_STREAMS = ("stdout", "stderr")
_LOCK = threading.Lock()
_open = 0
"""Captures open in the process (all threads): the streams are routed while it is above 0."""
_installed: dict[str, _Routed] = {}
_LOCAL = threading.local()
"""``buffers``: this thread's open captures, innermost last."""


class _Routed:
    """A stream that sends the writes of a thread with an open capture to it, the rest to ``target``."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def write(self, text: str) -> int:
        buffers = getattr(_LOCAL, "buffers", None)
        if buffers:
            return buffers[-1].write(text)
        return int(self.target.write(text) or 0)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not getattr(_LOCAL, "buffers", None):
            self.target.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno...: the stream's own
        return getattr(self.target, name)


@contextlib.contextmanager
def captured(what: str) -> Iterator[None]:
    """What this thread prints inside the block goes to aitune's log at DEBUG, as ``what printed: ...``."""
    global _open
    buffer = io.StringIO()
    with _LOCK:
        if _open == 0:
            _route()
        _open += 1
    buffers = _LOCAL.__dict__.setdefault("buffers", [])
    buffers.append(buffer)
    try:
        yield
    finally:
        buffers.pop()
        with _LOCK:
            _open -= 1
            if _open == 0:
                _unroute()
        text = buffer.getvalue().rstrip()
        if text:
            logger.debug("%s printed:\n%s", what, text)


def _route() -> None:
    for name in _STREAMS:
        current = getattr(sys, name, None)
        if current is not None and not isinstance(current, _Routed):
            _installed[name] = _Routed(current)
            setattr(sys, name, _installed[name])


def _unroute() -> None:
    """Put back the streams routed here; one that someone replaced since (a test's capture) stays theirs."""
    for name, routed in _installed.items():
        if getattr(sys, name, None) is routed:
            setattr(sys, name, routed.target)
    _installed.clear()
