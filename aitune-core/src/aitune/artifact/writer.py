"""``ait.save``: every wrapped module's winners, their payloads and the original weights, in one file."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import __version__, payload
from ..converter import unstructure
from ..engine.module import named_wrapped_modules
from ..envvars import check_switches
from ..errors import ArtifactError, InputError, SerializationError
from ..files import make_folders
from ..machine import environment
from ..plugins import AituneManager, get_manager
from ..registry import BackendRegistry
from ..report import TuneReport
from .archive import FORMAT_VERSION, MANIFEST, REPORT, Writer
from .format import GraphEntry, Manifest, ModuleEntry


def aitune_distributions() -> dict[str, str]:
    out = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name.lower().startswith("aitune-") and name.lower() != "aitune-workspace":
            out[name] = dist.version
    return dict(sorted(out.items()))


def runtime_versions(registry: BackendRegistry) -> dict[str, str]:
    """Versions of every runtime library an installed backend declares."""
    from packaging.requirements import Requirement

    out: dict[str, str] = {}
    for spec in registry:
        for text in spec.requirements:
            name = Requirement(text).name
            try:
                out[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
    return dict(sorted(out.items()))


def fingerprint(registry: BackendRegistry, device: torch.device | None = None) -> dict[str, Any]:
    env = environment(device or torch.device("cpu"))
    env["runtimes"] = runtime_versions(registry)
    return env


def _weights_bytes(module: torch.nn.Module) -> bytes:
    from safetensors.torch import save as save_tensors  # imported on use: it costs ~75 ms at import

    # clone() drops shared storage (tied weights), which safetensors refuses to write
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in module.state_dict().items()}
    return save_tensors(tensors)


def save(
    obj: Any,
    path: str | Path,
    *,
    signing_key: str | Path | None = None,
    sign: bool = True,
    manager: AituneManager | None = None,
) -> Path:
    """Write every ``ait.Module`` reachable from ``obj`` to one ``.ait`` file; returns its path.

    The file is written beside ``path`` and renamed into place, so an interrupted save leaves
    any previous artifact intact; it is 0644 at most and a missing folder is made 0700, whatever the
    umask. It is signed as it is written, inside the file (:mod:`aitune.artifact.seal`), with the
    user's own key (:mod:`aitune.artifact.ownkey`), which ``ait.load`` trusts by default: what a user
    saves loads back for that user with no flag, wherever the one file is copied. ``signing_key`` (a
    private key, PEM) also writes the detached model-signing bundle ``<path>.sig`` beside it, checked
    by ``ait.load(..., trusted_keys=[public key])``. ``sign=False`` (or ``AITUNE_OWN_KEY=0``) signs
    with neither. ``manager``: the plugin manager whose backends write the payloads (default: the
    process's, :func:`aitune.plugins.get_manager`).
    """
    check_switches()
    if signing_key is not None and not sign:
        raise InputError("signing_key and sign=False contradict each other: pass one of them")
    path = Path(path)
    named = named_wrapped_modules(obj)
    modules = [m for _, m in named]
    if not modules:
        raise ArtifactError("nothing to save: no ait.Module found; wrap and tune modules first")
    names = [m.name for m in modules]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ArtifactError(f"several wrapped modules share the names {duplicates}; give each ait.Module its own name")
    untuned = [m.name for m in modules if m.state == "recording"]
    if untuned:
        raise ArtifactError(f"modules {untuned} were never tuned; run ait.tune first (or leave them unwrapped)")
    for module in modules:
        if module.stale_reason is not None:
            raise ArtifactError(f"{module.name} cannot be saved: {module.stale_reason}")
    session = (get_manager() if manager is None else manager).session()
    make_folders(path.parent, "artifact")
    native = any(b.native_payload for m in modules for _, b in m.tuned_graphs)
    seal_with = _own_seal(path, sign, native=native and signing_key is None)
    devices = [spec.device for m in modules for g, _ in m.tuned_graphs for spec in g.inputs]
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        aitune_version=__version__,
        distributions=aitune_distributions(),
        environment=fingerprint(session.registry, torch.device(devices[0]) if devices else None),
    )
    writer = Writer(path)
    try:
        with tempfile.TemporaryDirectory(prefix="aitune-save-") as tmp:
            for i, (where, module) in enumerate(named):
                entry = ModuleEntry(
                    name=module.name,
                    weights=f"modules/{i}/weights.safetensors",
                    path=where,
                    strict=module.strict,
                    pad=dict(module.pad),
                )
                writer.add_bytes(entry.weights, _weights_bytes(module.module))
                for j, (graph, backend) in enumerate(module.tuned_graphs):
                    folder = Path(tmp) / f"{i}-{j}"
                    folder.mkdir()
                    prefix = f"modules/{i}/graphs/{j}"
                    try:
                        record = payload.write(backend, folder, session)
                    except payload.MetadataNotJSON as exc:
                        raise SerializationError(f"{module.name}: {exc}") from exc
                    files = sorted(record.files or {})
                    for rel in files:
                        writer.add_file(f"{prefix}/{rel}", folder / rel)
                    entry.graphs.append(
                        GraphEntry(
                            graph=graph,
                            backend=record.backend,
                            config=record.config,
                            distribution=record.distribution,
                            distribution_version=record.version,
                            payload=prefix,
                            files=files,
                            metadata=record.metadata,
                            refit=bool(backend.build_info.get("refitted")),
                        )
                    )
                manifest.modules.append(entry)
            writer.add_bytes(MANIFEST, json.dumps(unstructure(manifest), indent=1, sort_keys=True).encode())
            reports = [m.report for m in modules if m.report is not None]
            if reports:
                run = TuneReport(
                    aitune_version=__version__,
                    device=devices[0] if devices else "cpu",
                    environment=manifest.environment,
                    modules=reports,
                )
                writer.add_bytes(REPORT, json.dumps(run.to_json(), default=str).encode())
            writer.commit(seal_with)
    except BaseException:
        writer.abort()
        raise
    from .signing import sign as sign_detached
    from .signing import signature_path

    if signing_key is not None:
        sign_detached(path, signing_key)
    else:
        signature_path(path).unlink(missing_ok=True)  # it signed the file this save replaced
    return path


def _own_seal(path: Path, wanted: bool, *, native: bool) -> Callable[[bytes], bytes] | None:
    """What signs the digest list inside the file: the user's own key, unless signing is off or the key
    cannot be used; saving native code unsigned (when signing was wanted) warns, since ``ait.load``
    will then refuse it without a pin, a trusted key or ``trust_native_code=True``."""
    from . import ownkey, seal

    if not wanted:
        return None
    why = ownkey.off_reason()
    own = ownkey.get_or_create() if why is None else None
    if own is not None:
        key = own.private_pem
        return lambda sums: seal.make(sums, key)
    if native:
        warnings.warn(
            f"{path} holds native code and is saved unsigned ({why or 'your own key cannot be used: see the warning before this one'}), "
            "so ait.load refuses it without a pin, a trusted key or trust_native_code=True",
            RuntimeWarning,
            stacklevel=3,
        )
    return None
