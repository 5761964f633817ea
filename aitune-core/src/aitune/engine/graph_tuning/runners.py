"""What profiling times: a runner calls one backend on the recorded samples in turn.

A runner that raises (anything but out-of-memory) is tagged with its key (:class:`RunnerFailed`),
so one profiling round can tell which candidate failed and go on without it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ... import state
from ...backend import Backend
from ...graph import Sample


class RunnerFailed(Exception):
    """A runner raised (anything but out-of-memory) while being profiled."""

    def __init__(self, key: str, error: Exception) -> None:
        super().__init__(key)
        self.key = key
        self.error = error


def runner(backend: Backend, samples: Sequence[Sample], restore: bool = False) -> Callable[[], Any]:
    """Calls ``backend`` on each of ``samples`` in turn, as recorded.

    With ``restore`` (a graph that updates its inputs in place, as a KV cache's decode step
    does), each call gets inputs as they were recorded: ``prepare`` copies them back before the
    call, outside the timed region, so a measured call never runs past its cache's end.
    """
    if restore:
        return RestoringRunner(backend, samples)
    calls = itertools.cycle([(s.args, s.kwargs) for s in samples])
    infer = backend.infer

    def run() -> Any:
        args, kwargs = next(calls)
        return infer(*args, **kwargs)

    return run


class RestoringRunner:
    """Calls a backend on copies of the samples, set back to their recorded values before each call."""

    def __init__(self, backend: Backend, samples: Sequence[Sample]) -> None:
        self.infer = backend.infer
        self.work = [s.fresh() for s in samples]
        self.recorded = [s.tensors() for s in samples]
        self.slots = [state.counter_slots((w.args, w.kwargs)) for w in self.work]
        self.counts = [[getattr(o, n) for o, n in state.counter_slots((s.args, s.kwargs))] for s in samples]
        self.order = itertools.cycle(range(len(samples)))
        self.current: int | None = None

    def prepare(self) -> None:
        self.current = next(self.order)
        for mine, recorded in zip(self.work[self.current].tensors(), self.recorded[self.current]):
            mine.copy_(recorded)  # a step counter's leaf is a copy: its int is set back below
        for (layer, name), value in zip(self.slots[self.current], self.counts[self.current]):
            layer.__dict__[name] = value

    def __call__(self) -> Any:
        if self.current is None:
            self.prepare()
        assert self.current is not None
        sample, self.current = self.work[self.current], None
        return self.infer(*sample.args, **sample.kwargs)


def guarded(key: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn``, with any error but out-of-memory tagged with the runner it came from."""

    def run() -> Any:
        try:
            return fn()
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            raise RunnerFailed(key, exc) from exc

    run.prepare = getattr(fn, "prepare", None)  # type: ignore[attr-defined]
    return run
