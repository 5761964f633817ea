"""What the JIT remembers across runs: one decision per module, in ``<cache dir>/jit``.

A decision is keyed by everything that could change it: the module's code, structure and weights
(``module_code.module_digest``: the bytecode of every class in the tree, never memoized by
``id()``), the graph specs recorded for it, the strategy's identity (its class and whole frozen
config, :meth:`~aitune.engine.strategies.TuneStrategy.identity`), the candidate backends with
their configs and plugin versions, and the environment (aitune, torch, device, GPU or CPU model).
It holds the outcome (``tuned``, ``eager`` or ``descended``), and for a tuned module each graph's
winner: its graph JSON and its payload, written and read by :mod:`aitune.payload` (the record:
backend name, config JSON, metadata, file digests, distribution and version).
A changed forward, weight, input range, backend list, strategy parameter or upgrade gives another
key. Code the key cannot see (a module-level helper that forward calls) is why a remembered winner
is validated on the current calls before it is installed: a mismatch deletes the entry and the
module is tuned again, as is an entry that fails to load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from ... import __version__, machine, payload
from ...backend import Backend, LoadContext, payload_file
from ...cachedir import checked_entry, make_private, private_folder
from ...converter import unstructure
from ...errors import ConfigError, SerializationError
from ...graph import GraphSpec
from ...module_code import module_digest
from ...registry import BackendRegistry
from ..plan import TuneRun

logger = logging.getLogger("aitune")
FORMAT = 3
"""3: each winner is a payload record (:mod:`aitune.payload`) with its files' digests; entries of
older formats are tuned again."""
EAGER = "torch_eager"
DECISION = "decision.json"


@attrs.define
class Remembered:
    """A decision read back from the cache: the outcome, why, and each graph's loaded winner."""

    outcome: str
    reason: str
    winners: list[tuple[GraphSpec, Backend | None]]


def jit_dir() -> Path:
    return private_folder("jit")


def _backend_identity(registry: BackendRegistry, backend: Backend) -> dict[str, Any]:
    try:
        config: Any = registry.config_to_json(backend.config, backend.name)
    except (ConfigError, SerializationError):
        config = repr(backend.config)
    version = registry.status(backend.name).version if backend.name in registry else "unknown"
    return {"backend": backend.name, "config": config, "version": version}


def environment(device: torch.device) -> dict[str, Any]:
    """The parts of the machine a decision depends on."""
    env = machine.environment(device)
    out = {"aitune": __version__, "torch": torch.__version__, "device": str(device), "cuda": env.get("cuda")}
    for name in ("gpu", "compute_capability"):
        if name in env:
            out[name] = env[name]
    if device.type == "cpu":
        out["cpu"] = env.get("cpu")
    return out


def decision_key(run: TuneRun, module: torch.nn.Module, graphs: Sequence[GraphSpec], strategy: str) -> str:
    """The key of ``module``'s decision for ``graphs`` under ``strategy`` (its ``identity()``) with the
    run's candidates. Keys made when ``strategy`` was the strategy's repr are never made again."""
    payload = {
        "format": FORMAT,
        "module": module_digest(module),
        "graphs": [unstructure(g.without_values()) for g in graphs],  # the data's values choose no winner
        "strategy": strategy,
        "candidates": [_backend_identity(run.registry, b) for b in run.defaults],
        "environment": environment(run.device),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _entry(key: str) -> Path:
    return jit_dir() / key[:2] / key


def forget(key: str) -> None:
    """Delete one remembered decision (it proved wrong for the module as it is now)."""
    shutil.rmtree(_entry(key), ignore_errors=True)


def save(
    run: TuneRun,
    key: str,
    *,
    name: str,
    outcome: str,
    reason: str,
    winners: Sequence[tuple[GraphSpec, Backend]] = (),
) -> bool:
    """Write one decision atomically; returns False (and stores nothing) when a winner cannot be saved."""
    entry = _entry(key)
    private_folder("jit", entry.parent.name)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    try:
        graphs = []
        for index, (graph, backend) in enumerate(winners):
            record: dict[str, Any] = {"graph": unstructure(graph), "backend": backend.name}
            if backend.name != EAGER:
                folder = staging / str(index)
                folder.mkdir()
                record.update(payload.to_json(payload.write(backend, folder, run.session)), payload=str(index))
            graphs.append(record)
        decision = {"format": FORMAT, "name": name, "outcome": outcome, "reason": reason, "graphs": graphs}
        (staging / DECISION).write_text(json.dumps(decision, indent=1, default=str))
        make_private(staging)
        if entry.exists():
            shutil.rmtree(entry, ignore_errors=True)
        os.replace(staging, entry)
        return True
    except Exception as exc:  # not remembering is never fatal: the next run tunes again
        logger.info("aitune jit: the decision for %s is not remembered: %s: %s", name, type(exc).__name__, exc)
        return False
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load(run: TuneRun, key: str, name: str, module: torch.nn.Module, graphs: Sequence[GraphSpec]) -> Remembered | None:
    """The remembered decision with its winners loaded (no build), or None when there is none or it is unusable."""
    entry = _entry(key)
    path = entry / DECISION
    if not checked_entry(entry) or not path.is_file():
        return None
    from ...cachedir import cache_dir

    try:
        decision = json.loads(path.read_text())
        if decision.get("format") != FORMAT:
            raise ValueError(f"format {decision.get('format')!r}, expected {FORMAT}")
        winners: list[tuple[GraphSpec, Backend | None]] = []
        saved = decision["graphs"]
        if saved and len(saved) != len(graphs):
            raise ValueError(f"{len(saved)} graphs remembered, {len(graphs)} recorded")
        for graph, record in zip(graphs, saved):
            if record["backend"] == EAGER:
                winners.append((graph, None))
                continue
            folder = payload_file(entry, record["payload"])
            kept = payload.from_json({k: v for k, v in record.items() if k not in ("graph", "payload")}, name)
            context = LoadContext(graph, run.device, dict(kept.metadata), cache_dir(), name)
            # the entry is this user's private folder (checked above), written by an earlier run
            winners.append((graph, payload.read(kept, folder, module, context, run.session, True)))
        return Remembered(decision["outcome"], decision.get("reason", ""), winners)
    except Exception as exc:
        logger.warning(
            "aitune jit: the remembered decision for %s cannot be used (%s: %s); tuning it again",
            name,
            type(exc).__name__,
            exc,
        )
        shutil.rmtree(entry, ignore_errors=True)
        return None
