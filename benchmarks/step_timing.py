"""Where a generated token's time goes: the wrapped modules' calls, and inside a tuned decode step,
Dynamo's compiled-module call and the Inductor-generated code it runs.

Timed with ``time.perf_counter`` at three points while :func:`timed` is active, not with a profiler
(cProfile and ``torch.profiler`` add a cost per Python call or per op that inflates exactly the
wrappers being measured):

- each wrapped module is replaced in its parent by :class:`Timed`, which times the call as the
  model's code makes it (for a tuned module: aitune's dispatcher and backend, and all below; a
  backend's ``infer`` cannot be timed from outside, since aitune binds it when it installs winners);
- ``OptimizedModule.__call__`` (what ``torch.compile`` returns) is timed: Dynamo's frame
  evaluation, its guards, AOTAutograd's runtime wrappers and the compiled code;
- ``CompiledFxGraph.__call__`` is timed: the Inductor-generated ``call`` (its C++ kernels and the
  extern matmuls it calls), nothing of Dynamo's.

Each timer costs two ``perf_counter`` calls and a list append (well under a microsecond) per call.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Calls:
    """Per-call times in seconds, in call order."""

    wrapped: dict[str, list[float]] = field(default_factory=dict)
    compiled: list[float] = field(default_factory=list)
    kernels: list[float] = field(default_factory=list)


class Timed(torch.nn.Module):
    """Stands in for a module in its parent and times each call it passes on; attributes read
    through it come from the module, as the model's code expects."""

    def __init__(self, inner: torch.nn.Module, sink: list[float]) -> None:
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "sink", sink)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.sink.append(time.perf_counter() - start)
        return out


def _timing(cls: type, name: str, sink: list[float]) -> Any:
    original = cls.__dict__[name]

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = original(self, *args, **kwargs)
        sink.append(time.perf_counter() - start)
        return out

    return original, call


@contextlib.contextmanager
def swapped(model: torch.nn.Module, swaps: Sequence[tuple[str, torch.nn.Module]]) -> Iterator[None]:
    """Each ``(path, module)`` of ``swaps`` put at ``path`` in ``model`` until the block ends, then
    what was there put back."""
    held = []
    try:
        for path, module in swaps:
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            held.append((parent, attr, getattr(parent, attr)))
            setattr(parent, attr, module)
        yield
    finally:
        for parent, attr, was in held:
            setattr(parent, attr, was)


@contextlib.contextmanager
def timed(model: torch.nn.Module, swaps: Sequence[tuple[str, torch.nn.Module]]) -> Iterator[Calls]:
    """Put each ``(path, module)`` of ``swaps`` at ``path`` in ``model`` behind a :class:`Timed`, and
    time the compiled-module and Inductor calls, until the block ends (then all is put back)."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch._inductor.output_code import CompiledFxGraph

    calls = Calls()
    behind = [(path, Timed(module, calls.wrapped.setdefault(path, []))) for path, module in swaps]
    patches = [
        (OptimizedModule, "__call__", *_timing(OptimizedModule, "__call__", calls.compiled)),
        (CompiledFxGraph, "__call__", *_timing(CompiledFxGraph, "__call__", calls.kernels)),
    ]
    with swapped(model, behind):
        for cls, name, _, patched in patches:
            setattr(cls, name, patched)
        try:
            yield calls
        finally:
            for cls, name, original, _ in patches:
                setattr(cls, name, original)
