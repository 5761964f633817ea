"""Ranks of a ``torch.distributed`` job that tune together: one decision, the same winners everywhere.

aitune never starts a process group. When the application has initialized one (``torchrun`` and
``init_process_group``) with more than one rank, every ``ait.tune`` call coordinates through a
gloo group that aitune makes on top of it, so that whatever the application's backend (NCCL
included) messages are CPU tensors of JSON text, never pickles, and waits obey
``AITUNE_DISTRIBUTED_TIMEOUT_S`` (default 2 hours: rank 0 may tune for long) rather than the
application's own timeout. With only ``RANK``/``WORLD_SIZE`` set and no process group, ranks
keep their own cache folders and reports but cannot agree, and aitune says so once. An
application that tunes on some ranks only (``if rank == 0: ait.tune(...)``) sets
``AITUNE_DISTRIBUTED=off``: every rank must call ``ait.tune`` together otherwise.

Every step ends with an exchange of each rank's status, so a failure on any rank fails the tune
on every rank with that rank's error, and no rank waits for one that gave up. Steps are named, and
ranks that reach differently named steps at one exchange (one went another way) fail together too.

Who decides (``ait.tune(..., rank_decision=...)`` or ``AITUNE_RANK_DECISION``): ``rank0`` (the
default) tunes on rank 0 and installs its winners everywhere; ``slowest`` tunes on every rank in
lockstep, each timing its own builds, and every figure decided on is the slowest rank's.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import json
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import envvars
from .errors import ConfigError, DistributedTuneError

logger = logging.getLogger("aitune")

_groups: dict[int, Any] = {}
"""aitune's own gloo group per WORLD group. Dropped at exit while the interpreter is whole: a
process group torch destroys during interpreter teardown can abort the process (gloo threads)."""
atexit.register(_groups.clear)
_warned = False


def _initialized() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


def rank_and_size() -> tuple[int, int] | None:
    """``(rank, world_size)`` of this process in a job of several ranks, else None.

    From the initialized process group, else from ``RANK`` and ``WORLD_SIZE`` (as torchrun sets them).
    """
    if _initialized():
        import torch.distributed as dist

        size = dist.get_world_size()
        return (dist.get_rank(), size) if size > 1 else None
    try:
        rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    return (rank, size) if size > 1 and 0 <= rank < size else None


def rank_label() -> str | None:
    """``rank-R-of-W`` in a job of several ranks: the name of this rank's cache folder and report."""
    ranks = rank_and_size()
    return f"rank-{ranks[0]}-of-{ranks[1]}" if ranks else None


def per_rank_path(path: str | Path) -> Path:
    """``tune.json`` -> ``tune.rank-1-of-2.json`` in a job of several ranks; unchanged otherwise."""
    path, label = Path(path), rank_label()
    if label is None:
        return path
    return path.with_name(f"{path.stem}.{label}{path.suffix}")


def timeout_s() -> float:
    """How long a rank waits for the others, in seconds: ``AITUNE_DISTRIBUTED_TIMEOUT_S``."""
    return envvars.DISTRIBUTED_TIMEOUT_S.get()


RANK_DECISIONS = ("rank0", "slowest")


def rank_decision(value: str | None = None) -> str:
    """Who decides for the ranks: ``value``, else ``AITUNE_RANK_DECISION``, else ``rank0``."""
    given = (value or "").strip().lower()
    chosen = given or envvars.RANK_DECISION.get()
    if chosen not in RANK_DECISIONS:
        where = "rank_decision" if given else envvars.RANK_DECISION.name
        raise ConfigError(
            f"{where}={chosen!r} is not one of {', '.join(RANK_DECISIONS)}: rank0 tunes on rank 0 and "
            "installs its winners everywhere; slowest times on every rank and decides on the slowest rank's figures"
        )
    return chosen


def enabled() -> bool:
    """``AITUNE_DISTRIBUTED``: ``auto`` (coordinate when there are ranks) or ``off``."""
    return envvars.DISTRIBUTED.get() == "auto"


def coordinator() -> Coordinator | None:
    """The coordinator of this job's ranks, or None when there is nothing to coordinate."""
    global _warned
    if not enabled():
        return None
    if not _initialized():
        ranks = rank_and_size()
        if ranks is not None and not _warned:
            _warned = True
            warnings.warn(
                f"WORLD_SIZE={ranks[1]} but torch.distributed is not initialized, so the ranks tune on their own "
                "and may choose differently; call torch.distributed.init_process_group() before ait.tune "
                "so that they agree",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    import torch.distributed as dist

    if dist.get_world_size() < 2:
        return None
    world = dist.group.WORLD
    group = _groups.get(id(world))
    if group is None:  # every rank reaches this in its first ait.tune, so they create it together
        timeout = datetime.timedelta(seconds=timeout_s())
        group = dist.new_group(backend="gloo", timeout=timeout)
        _groups.clear()
        _groups[id(world)] = group
    return Coordinator(dist.get_rank(), dist.get_world_size(), group)


class Coordinator:
    """This rank's view of the others: JSON exchanges and steps that fail together."""

    def __init__(self, rank: int, world_size: int, group: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.inbox: list[dict[str, Any]] = []

    @property
    def label(self) -> str:
        return f"rank-{self.rank}-of-{self.world_size}"

    def exchange(self, text: str, step: str) -> list[str]:
        """Send ``text`` to every rank and receive theirs, by rank (two gloo all-gathers of bytes)."""
        import torch
        import torch.distributed as dist

        data = text.encode()
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._wait(dist.all_gather(sizes, size, group=self.group, async_op=True), step)
        longest = max(int(s.item()) for s in sizes) or 1
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        received = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(dist.all_gather(received, mine, group=self.group, async_op=True), step)
        return [ctypes.string_at(t.data_ptr(), int(s.item())).decode() for t, s in zip(received, sizes)]

    def _wait(self, work: Any, step: str) -> None:
        try:
            work.wait()
        except Exception as exc:
            raise DistributedTuneError(
                f"{self.label} gave up waiting for the other ranks while {step} ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}): a rank died or is stuck (its own log says "
                "why), or rank 0's tune took longer than AITUNE_DISTRIBUTED_TIMEOUT_S",
                final=True,
            ) from exc

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[dict[str, Any]]:
        """Run the body on every rank, then exchange outcomes: any rank's failure fails all.

        The body may put JSON-able values into the dict it gets; afterwards ``inbox`` holds every
        rank's dict, by rank.
        """
        outbox: dict[str, Any] = {}
        error: Exception | None = None
        try:
            yield outbox
        except DistributedTuneError as exc:
            if exc.final:  # every rank knows already (an inner step's exchange), or none can be reached
                raise
            error = exc
        except Exception as exc:
            error = exc
        if error is None:
            message = {"ok": True, "step": name, **outbox}
        else:
            message = {"ok": False, "step": name, "error": f"{type(error).__name__}: {error}"}
        self.inbox = [json.loads(t) for t in self.exchange(json.dumps(message, default=str), name)]
        failed = [(rank, m["error"]) for rank, m in enumerate(self.inbox) if not m["ok"]]
        if failed:
            rank, text = failed[0]
            more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
            raise DistributedTuneError(
                f"ait.tune failed on rank {rank} of {self.world_size} while {self.inbox[rank]['step']}{more}: {text}",
                rank=rank,
                final=True,
            ) from error
        strayed = next((r for r, m in enumerate(self.inbox) if m["step"] != self.inbox[0]["step"]), None)
        if strayed is not None:
            raise DistributedTuneError(
                f"the ranks went different ways: rank 0 was {self.inbox[0]['step']} while rank {strayed} was "
                f"{self.inbox[strayed]['step']}; with rank_decision='slowest' every rank must build and validate "
                "the same candidates (rank_decision='rank0' tolerates machines that differ)",
                rank=strayed,
                final=True,
            )


@contextlib.contextmanager
def step(ranks: Coordinator | None, name: str) -> Iterator[dict[str, Any]]:
    """:meth:`Coordinator.step`, or a plain block in a single process."""
    if ranks is None:
        yield {}
        return
    with ranks.step(name) as outbox:
        yield outbox
