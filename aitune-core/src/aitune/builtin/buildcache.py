"""The build cache: a wrapper on ``aitune_build`` that skips builds it has seen before.

Entries are content-addressed by the module's structure and weights, the graph, the backend and
its config, the versions of aitune, the plugin and torch, and the device. A hit loads the saved
payload through ``aitune_deserialize`` instead of building; a miss builds, then saves the
payload into the cache. ``AITUNE_BUILD_CACHE=0`` turns it off.

Its two hook implementations take the run's ``session`` and call other hooks through it, never
through a global manager.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch

from .. import __version__, hookimpl
from ..backend import Backend, BuildContext, LoadContext
from ..cachedir import changed, checked_entry, digests, make_private, private_folder
from ..converter import unstructure
from ..errors import SerializationError
from ..module_code import code_digest
from ..registry import BackendRegistry
from ..session import Session

logger = logging.getLogger("aitune")
_digests: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, str]] = weakref.WeakKeyDictionary()
"""Per live module (never by ``id()``, which a new module can reuse): its weights' stamp and digest."""


def enabled() -> bool:
    return os.environ.get("AITUNE_BUILD_CACHE", "1").strip().lower() not in {"0", "false", "no", "off"}


def builds_dir() -> Path:
    return private_folder("builds")


def module_digest(module: torch.nn.Module) -> str:
    """SHA-256 of the module's code, structure and every weight; memoized while the weights are unchanged."""
    state = module.state_dict(keep_vars=True)
    code = code_digest(module)
    stamp = (code, tuple((k, v.data_ptr(), v._version, tuple(v.shape)) for k, v in state.items()))
    cached = _digests.get(module)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    digest = hashlib.sha256(f"{type(module).__module__}.{type(module).__qualname__}\n{code}\n{module}".encode())
    for name, tensor in state.items():
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.numel():  # raw bytes through ctypes: torch's CPU wheel does not bring numpy
            digest.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    _digests[module] = (stamp, digest.hexdigest())
    return digest.hexdigest()


def build_key(backend: Backend, module: torch.nn.Module, context: BuildContext, registry: BackendRegistry) -> str:
    plugin_version = registry.status(backend.name).version if backend.name in registry else "unknown"
    payload = {
        "module": module_digest(module),
        "graph": unstructure(context.graph),
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
        why = changed(entry / "payload", meta.get("files"))
        if why:
            raise SerializationError(f"the entry is not as it was stored: {why}")
        load_ctx = LoadContext(context.graph, context.device, meta["metadata"], context.cache_dir, context.module_name)
        start = time.perf_counter()
        loaded = session.hook.aitune_deserialize(
            backend=backend, module=module, directory=entry / "payload", context=load_ctx, session=session
        )
    except Exception as exc:  # a broken entry is dropped and rebuilt, never fatal
        logger.warning("build cache entry %s is unusable (%s: %s); rebuilding", entry.name, type(exc).__name__, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    loaded.build_info.update(meta.get("build_info", {}))
    loaded.build_info["from_cache"] = True
    loaded.build_info["cache_key"] = entry.name
    loaded.build_info["cache_load_s"] = time.perf_counter() - start
    return loaded  # type: ignore[no-any-return]


def evict(key: str | None) -> None:
    """Drop the entry ``key`` (a cached build that failed validation is rebuilt next time)."""
    if key and len(key) == 64 and all(c in "0123456789abcdef" for c in key):
        shutil.rmtree(builds_dir() / key[:2] / key, ignore_errors=True)


def _store(entry: Path, backend: Backend, session: Session) -> None:
    private_folder("builds", entry.parent.name)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    try:
        (staging / "payload").mkdir()
        metadata = session.hook.aitune_serialize(backend=backend, directory=staging / "payload", session=session)
        info = {k: v for k, v in backend.build_info.items() if k not in ("from_cache", "cache_key")}
        files = digests(staging / "payload")
        record = {"backend": backend.name, "metadata": metadata or {}, "build_info": info, "files": files}
        (staging / "meta.json").write_text(json.dumps(record, default=str))
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
