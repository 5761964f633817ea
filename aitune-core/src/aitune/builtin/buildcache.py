"""The build cache: a wrapper on ``aitune_build`` that skips builds it has seen before.

Entries are content-addressed by the module's structure and weights, the graph, the backend and
its config, the versions of aitune, the plugin and torch, and the device. A hit loads the saved
payload through ``aitune_deserialize`` instead of building; a miss builds, then saves the
payload into the cache. ``AITUNE_BUILD_CACHE=0`` turns it off.

Payloads go through :mod:`aitune.payload`, like the artifact's. Its build hook implementations take
the run's ``session`` and call other hooks through it, never through a global manager; an
``aitune_candidate_result`` observer drops an entry whose build failed validation, so unregistering
the plugin turns all of it off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import __version__, hookimpl, payload
from ..backend import Backend, BuildContext, LoadContext
from ..cachedir import checked_entry, make_private, private_folder
from ..converter import unstructure
from ..envvars import BUILD_CACHE
from ..errors import SerializationError
from ..module_code import module_digest
from ..registry import BackendRegistry
from ..session import Session

if TYPE_CHECKING:  # the tuner's report: a load registers this plugin and never imports it
    from ..report import CandidateReport

logger = logging.getLogger("aitune")


def enabled() -> bool:
    return BUILD_CACHE.get()


def builds_dir() -> Path:
    return private_folder("builds")


def build_key(backend: Backend, module: torch.nn.Module, context: BuildContext, registry: BackendRegistry) -> str:
    plugin_version = registry.status(backend.name).version if backend.name in registry else "unknown"
    payload = {
        "module": module_digest(module),
        "graph": unstructure(context.graph.without_values()),  # a build does not depend on the data's values
        "backend": backend.name,
        "config": registry.config_to_json(backend.config, backend.name),
        "versions": {"aitune": __version__, "plugin": plugin_version, "torch": torch.__version__},
        "device": str(context.device),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _load_hit(
    entry: Path, backend: Backend, module: torch.nn.Module, context: BuildContext, session: Session
) -> Backend | None:
    try:
        meta = json.loads((entry / "meta.json").read_text())
        record = payload.from_json({k: v for k, v in meta.items() if k != "build_info"}, "meta.json")
        load_ctx = LoadContext(context.graph, context.device, record.metadata, context.cache_dir, context.module_name)
        start = time.perf_counter()
        # the entry is this user's private folder, keyed by this very backend and config
        loaded = payload.read(record, entry / "payload", module, load_ctx, session, True, backend=backend)
    except Exception as exc:  # a broken entry is dropped and rebuilt, never fatal
        logger.warning("build cache entry %s is unusable (%s: %s); rebuilding", entry.name, type(exc).__name__, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    loaded.build_info.update(meta.get("build_info", {}))
    loaded.build_info["from_cache"] = True
    loaded.build_info["cache_key"] = entry.name
    loaded.build_info["cache_load_s"] = time.perf_counter() - start
    return loaded


def evict(key: str | None) -> None:
    """Drop the entry ``key`` (a cached build that failed validation is rebuilt next time)."""
    if key and len(key) == 64 and all(c in "0123456789abcdef" for c in key):
        shutil.rmtree(builds_dir() / key[:2] / key, ignore_errors=True)


@hookimpl(specname="aitune_candidate_result")
def drop_rejected(candidate: CandidateReport) -> None:
    """A cached build that no longer matches eager is dropped, so the next tune builds it afresh
    (one the user's metric judged is kept: the metric, not the cache, rejected it)."""
    from ..report import CandidateStatus

    validation = candidate.validation
    if (
        candidate.status == CandidateStatus.FAILED
        and candidate.stage == "validate"
        and candidate.metric is None
        and validation is not None
        and not validation.passed
    ):
        evict(candidate.build_info.get("cache_key"))


def _store(entry: Path, backend: Backend, session: Session) -> None:
    private_folder("builds", entry.parent.name)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    try:
        (staging / "payload").mkdir()
        record = payload.write(backend, staging / "payload", session)
        info = {k: v for k, v in backend.build_info.items() if k not in ("from_cache", "cache_key")}
        meta = {**payload.to_json(record), "build_info": info}
        (staging / "meta.json").write_text(json.dumps(meta, default=str))
        make_private(staging)
        os.replace(staging, entry)
    except (SerializationError, OSError) as exc:
        logger.debug("build of %s not cached: %s", backend.name, exc)
    except Exception as exc:
        logger.warning("build of %s not cached: %s: %s", backend.name, type(exc).__name__, exc)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _entry(backend: Backend, module: torch.nn.Module, context: BuildContext, registry: BackendRegistry) -> Path | None:
    if not enabled():
        return None
    try:
        key = build_key(backend, module, context, registry)
    except Exception as exc:  # a config that cannot be keyed is built, not cached
        logger.debug("build of %s not cached: %s", backend.name, exc)
        return None
    return builds_dir() / key[:2] / key


@hookimpl(specname="aitune_build", tryfirst=True)
def lookup(backend: Backend, module: torch.nn.Module, context: BuildContext, session: Session) -> Backend | None:
    """A hit answers the build with the cached payload; a miss lets the builders run."""
    entry = _entry(backend, module, context, session.registry)
    if entry is None or not checked_entry(entry) or not (entry / "meta.json").is_file():
        return None
    return _load_hit(entry, backend, module, context, session)


@hookimpl(specname="aitune_build", wrapper=True)
def store(
    backend: Backend, module: torch.nn.Module, context: BuildContext, session: Session
) -> Generator[None, Any, Any]:
    """After a fresh build, save its payload into the cache."""
    built = yield
    if built is not None and not built.build_info.get("from_cache"):
        entry = _entry(backend, module, context, session.registry)
        if entry is not None:
            _store(entry, built, session)
    return built


def info() -> dict[str, Any]:
    root = builds_dir()
    entries = [p for p in root.glob("*/*") if p.is_dir() and not p.name.startswith(".")] if root.exists() else []
    size = sum(f.stat().st_size for e in entries for f in e.rglob("*") if f.is_file())
    return {"path": str(root), "entries": len(entries), "bytes": size}


def clear() -> int:
    root = builds_dir()
    count = info()["entries"]
    shutil.rmtree(root, ignore_errors=True)
    return int(count)
