"""The payload store: how a built backend is written to a folder and read back, everywhere.

The artifact (``ait.save``, ``ait.load``), the build cache and the JIT's decision store all write
a payload with :func:`write`, through the ``aitune_serialize`` hook, and read it with :func:`read`,
through ``aitune_deserialize``. A :class:`PayloadRecord` is what is kept beside the files: the
backend's name and config, the metadata its ``save`` returned, each file's SHA-256, and the
distribution that provides the backend with its version.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from .cachedir import changed, digests
from .converter import structure
from .errors import SerializationError

if TYPE_CHECKING:
    from .backend import Backend, LoadContext
    from .session import Session


class MetadataNotJSON(SerializationError):
    """A backend's ``save`` returned metadata that cannot be written as JSON."""


@attrs.frozen
class PayloadRecord:
    """What :func:`write` wrote into a folder, and what :func:`read` needs to load it again."""

    backend: str
    config: dict[str, Any]
    """The backend's config as ``BackendRegistry.config_to_json`` writes it."""
    metadata: dict[str, Any]
    """What the backend's ``save`` returned; handed back to its ``load``."""
    files: dict[str, str] | None
    """SHA-256 of each file by its path in the folder; None when the container checks them (the artifact's sums)."""
    distribution: str
    version: str


def to_json(record: PayloadRecord) -> dict[str, Any]:
    return attrs.asdict(record)


def from_json(data: Any, what: str = "payload") -> PayloadRecord:
    """A record read back from a file, each field checked (what a file holds is untrusted)."""
    return structure(data, PayloadRecord, what)


def write(backend: Backend, folder: Path, session: Session) -> PayloadRecord:
    """Serialize ``backend`` into ``folder`` (``aitune_serialize``) and describe what was written."""
    registry = session.registry
    metadata = session.hook.aitune_serialize(backend=backend, directory=folder, session=session) or {}
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as exc:
        raise MetadataNotJSON(f"{backend.name} returned metadata that is not JSON: {exc}") from exc
    return PayloadRecord(
        backend=backend.name,
        config=registry.config_to_json(backend.config, backend.name),
        metadata=metadata,
        files=digests(folder),
        distribution=registry.distribution(backend.name),
        version=registry.status(backend.name).version,
    )


def read(
    record: PayloadRecord,
    folder: Path,
    module: torch.nn.Module,
    context: LoadContext,
    session: Session,
    trust: bool,
    *,
    backend: Backend | None = None,
) -> Backend:
    """Load the payload ``record`` describes from ``folder`` (``aitune_deserialize``); no build.

    The files must still have the digests ``record`` lists. ``trust``: the bytes are vouched for,
    so a backend whose payload is native code may load them. ``backend``: the backend to load into
    when the caller holds it already (the build cache's template); otherwise it is made from the
    record's config, read as a config from a file.
    """
    if record.files is not None:
        why = changed(folder, record.files)
        if why:
            raise SerializationError(f"the payload is not as it was written: {why}")
    registry = session.registry
    if backend is None:
        config = registry.config_from_json(record.config, f"{context.module_name}.config", from_file=True)
        backend = registry.backend_class(record.backend)(config)
    if backend.native_payload and not trust:
        raise SerializationError(f"the {record.backend} payload is native code and its bytes are not vouched for")
    with torch.no_grad():
        loaded: Backend = session.hook.aitune_deserialize(
            backend=backend, module=module, directory=folder, context=context, session=session
        )
    return loaded


def size(backend: Backend, session: Session) -> int | None:
    """What :func:`write` would write for ``backend``, in bytes; None when it cannot be written."""
    folder = Path(tempfile.mkdtemp(prefix="aitune-size-"))
    try:
        session.hook.aitune_serialize(backend=backend, directory=folder, session=session)
        return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    except Exception:
        return None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
