"""``ait.load``: fill a freshly built model from an artifact and return it tuned, with no build.

Every member's digest is checked before a runtime parses it, weights come from safetensors,
and configs and the manifest from JSON: nothing is unpickled. A payload that cannot run here
(missing plugin, CUDA payload without CUDA, a runtime that refuses it) raises a clear error, or
with ``fallback="eager"`` leaves that module eager with a warning.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .. import tree
from ..backend import Backend, LoadContext
from ..converter import config_from_json, structure
from ..errors import AituneError, ArtifactError, InputError
from ..plugins import get_manager
from ..registry import missing_requirements
from ..torch.module import Module, wrapped_modules
from .archive import FORMAT_VERSION, MANIFEST, MAX_MANIFEST_BYTES, REPORT, Reader, open_artifact
from .format import GraphEntry, Manifest, ModuleEntry

DeviceMap = str | torch.device | Mapping[str, str | torch.device] | None


def read_manifest(reader: Reader) -> Manifest:
    raw = reader.read(MANIFEST, limit=MAX_MANIFEST_BYTES)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ArtifactError(f"{reader.path}: the manifest is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ArtifactError(f"{reader.path}: the manifest is not a JSON object")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{reader.path} uses artifact format {version!r}; this aitune reads format {FORMAT_VERSION}: "
            "install the aitune version that wrote it, or tune again"
        )
    try:
        return structure(data, Manifest, "manifest")
    except AituneError as exc:
        raise ArtifactError(f"{reader.path}: the manifest is malformed: {exc}") from exc
    except RecursionError as exc:
        raise ArtifactError(f"{reader.path}: the manifest is nested too deeply") from exc


def _device_for(name: str, device_map: DeviceMap, entry: ModuleEntry) -> torch.device:
    if isinstance(device_map, Mapping):
        if name in device_map:
            return torch.device(device_map[name])
    elif device_map is not None:
        return torch.device(device_map)
    saved = {spec.device for g in entry.graphs for spec in g.graph.inputs}
    device = saved.pop() if len(saved) == 1 else "cpu"
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ArtifactError(
            f"{entry.name}: the manifest names an unknown device {device!r}; the file is corrupt"
        ) from exc


def _incompatible(entry: GraphEntry, device: torch.device) -> str | None:
    """Why this graph's payload cannot run here, checked before any runtime sees it."""
    registry = get_manager().registry
    if entry.backend not in registry:
        return (
            f"backend {entry.backend!r} is not installed: pip install "
            f"'{entry.distribution}=={entry.distribution_version}'"
        )
    saved = {spec.device for spec in entry.graph.inputs}
    if saved and device.type not in saved:
        return f"the payload was built for {'/'.join(sorted(saved))} but is being loaded onto {device.type}"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "the payload needs a CUDA device and none is visible here"
    # only the runtime libraries: a build-time need (a compiler for Inductor) must not block a load
    return missing_requirements(registry.spec(entry.backend).requirements)


def load(
    obj: Any,
    path: str | Path,
    device_map: DeviceMap = None,
    *,
    fallback: str | None = None,
    expected_sha256: str | None = None,
) -> Any:
    """Load the artifact at ``path`` into ``obj`` (a freshly built model or pipeline) and return it.

    ``obj`` must contain ``ait.Module`` wrappers with the names that were saved. Weights are
    restored too, so calls outside the tuned ranges can still run eager. ``fallback="eager"``
    keeps a module whose payload cannot run here eager (with a warning) instead of raising.
    """
    if fallback not in (None, "eager"):
        raise ValueError("fallback must be None or 'eager'")
    path = Path(path)
    targets = {m.name: m for m in wrapped_modules(obj)}
    if not targets:
        raise ArtifactError("the object to load into contains no ait.Module; wrap the same modules as when saving")
    with open_artifact(path, expected_sha256) as reader:
        manifest = read_manifest(reader)
        missing = [m.name for m in manifest.modules if m.name not in targets]
        if missing:
            raise ArtifactError(
                f"{path} holds modules {missing} that the given object does not wrap (it wraps {sorted(targets)})"
            )
        with tempfile.TemporaryDirectory(prefix="aitune-load-") as tmp:
            for entry in manifest.modules:
                try:
                    _load_module(reader, entry, targets[entry.name], device_map, fallback, Path(tmp))
                except AituneError:
                    raise
                except Exception as exc:  # an inconsistent manifest that passed its schema (found by fuzzing)
                    raise ArtifactError(
                        f"{path}: {entry.name} cannot be loaded from this artifact ({type(exc).__name__}: {exc}); "
                        "the file is corrupt or was written by an incompatible aitune: tune and save again"
                    ) from exc
    return obj


def _load_module(
    reader: Reader, entry: ModuleEntry, target: Module, device_map: DeviceMap, fallback: str | None, tmp: Path
) -> None:
    from safetensors.torch import load as load_tensors  # imported on use: it costs ~75 ms at import

    try:
        weights = load_tensors(reader.read(entry.weights))
    except AituneError:
        raise
    except Exception as exc:
        raise ArtifactError(f"{reader.path}: weights of {entry.name!r} cannot be read: {exc}") from exc
    try:
        target.module.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise ArtifactError(
            f"{reader.path}: the weights of {entry.name!r} do not fit the module given to load "
            f"(is it the same architecture?): {exc}"
        ) from exc
    device = _device_for(entry.name, device_map, entry)
    if device.type == "cuda" and not torch.cuda.is_available():
        message = f"{reader.path}: {entry.name} needs a CUDA device and none is visible here"
        if fallback != "eager":
            raise ArtifactError(message + "; load it on a GPU machine, or pass fallback='eager'")
        warnings.warn(message + "; running it eager on the CPU", RuntimeWarning, stacklevel=3)
        target._install([], None)
        return
    target.module.to(device)
    hook = get_manager().hook
    winners: list[tuple[Any, Backend]] = []
    for index, graph_entry in enumerate(entry.graphs):
        try:
            reason = _incompatible(graph_entry, device) or _unimportable(graph_entry)
            if reason:
                raise ArtifactError(f"{entry.name} graph {index}: {reason}")
            registry = get_manager().registry
            config = config_from_json(graph_entry.config, f"{entry.name}.graphs[{index}].config")
            backend = registry.backend_class(graph_entry.backend)(config)
            folder = tmp / f"{entry.name}-{index}".replace("/", "_")
            folder.mkdir()
            reader.extract(graph_entry.payload, folder)
            context = LoadContext(graph_entry.graph, device, dict(graph_entry.metadata), _cache(), entry.name)
            with torch.no_grad():
                loaded = hook.aitune_deserialize(
                    backend=backend, module=target.module, directory=folder, context=context
                )
            winners.append((graph_entry.graph, loaded))
        except ArtifactError as exc:
            if fallback != "eager" or "does not match its SHA-256" in str(exc):
                raise
            warnings.warn(f"{exc}; {entry.name} runs eager for that graph", RuntimeWarning, stacklevel=3)
        except Exception as exc:
            message = f"{reader.path}: {entry.name} graph {index} ({graph_entry.backend}) cannot be loaded here: {type(exc).__name__}: {exc}"
            if fallback != "eager":
                raise ArtifactError(message) from exc
            warnings.warn(message + "; running eager for that graph", RuntimeWarning, stacklevel=3)
    target._install(winners, None)


def _unimportable(entry: GraphEntry) -> str | None:
    """Why a type the graph's calls or outputs use cannot be imported here (they are rebuilt by import)."""
    try:
        tree.check_types(entry.graph.structure)
        if entry.graph.output_structure is not None:
            tree.check_types(entry.graph.output_structure)
    except InputError as exc:
        return f"{exc}, so its outputs cannot be rebuilt in their own type"
    return None


def _cache() -> Path:
    from ..cache import cache_dir

    return cache_dir()


def read_report(path: str | Path) -> Any:
    """The tuning report saved with the artifact (what ``aitune report model.ait`` shows)."""
    from ..report import TuneReport

    with open_artifact(Path(path)) as reader:
        read_manifest(reader)
        if REPORT not in reader.infos:
            raise ArtifactError(f"{path} carries no tuning report (it was saved from a loaded model)")
        raw = reader.read(REPORT, limit=MAX_MANIFEST_BYTES)
    try:
        return TuneReport.from_json(json.loads(raw))
    except (ValueError, AituneError) as exc:
        raise ArtifactError(f"{path}: the tuning report is malformed: {exc}") from exc


def verify(path: str | Path, expected_sha256: str | None = None) -> dict[str, Any]:
    """Check every digest and whether each payload can run here; returns what ``aitune verify`` prints."""
    path = Path(path)
    with open_artifact(path, expected_sha256) as reader:
        reader.verify_all()
        manifest = read_manifest(reader)
    problems = []
    for entry in manifest.modules:
        device = _device_for(entry.name, None, entry)
        for index, graph_entry in enumerate(entry.graphs):
            reason = _incompatible(graph_entry, device) or _unimportable(graph_entry)
            if reason:
                problems.append(f"{entry.name} graph {index} ({graph_entry.backend}): {reason}")
    return {"path": str(path), "integrity": "ok", "runnable_here": not problems, "problems": problems}
