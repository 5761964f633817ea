"""``ait.load``: fill a freshly built model from an artifact and return it tuned, with no build.

Every member's digest is checked before a runtime parses it, weights come from safetensors,
and configs and the manifest from JSON: nothing is unpickled. A payload that cannot run here
(missing plugin, CUDA payload without CUDA, a runtime that refuses it) raises a clear error, or
with ``fallback="eager"`` leaves that module eager with a warning.

Loading checks everything it can before it changes anything (the digests, the manifest, the
model object's structure, every device, config and bound, the trust policy); only then are the
payloads loaded and installed.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from .. import payload, tree
from ..backend import Backend, LoadContext
from ..converter import structure
from ..engine.generation import StaticCacheSwitch
from ..engine.install import install
from ..engine.module import Module, freeze_tuned, wrapped_modules
from ..engine.options import check_pad
from ..engine.settings import settings
from ..engine.winners import Winner
from ..envvars import check_switches
from ..errors import AituneError, ArtifactError, ArtifactIntegrityError, InputError
from ..graph import GraphSpec
from ..payload import PayloadRecord
from ..plugins import AituneManager, get_manager
from ..registry import BackendRegistry, missing_requirements
from ..session import Session
from . import ownkey, seal
from .archive import FORMAT_VERSION, MANIFEST, MAX_MANIFEST_BYTES, REPORT, Reader, open_artifact
from .bounds import graph_problem
from .format import GraphEntry, Manifest, ModuleEntry
from .options import DeviceMap, LoadOptions
from .signing import signature_path, verify_signature

FILE_DEVICES = ("cpu", "cuda")
"""The device types a manifest may name; ``meta`` and the rest would move the user's weights away."""


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
        manifest = structure(data, Manifest, "manifest")
        for entry in manifest.modules:  # bounded before anything uses it: names and finite numbers, at most 64
            entry.pad = check_pad(entry.pad, f"module {entry.name!r}'s pad")
        return manifest
    except AituneError as exc:
        raise ArtifactError(f"{reader.path}: the manifest is malformed: {exc}") from exc
    except RecursionError as exc:
        raise ArtifactError(f"{reader.path}: the manifest is nested too deeply") from exc


def _device_for(entry: ModuleEntry, chosen: torch.device | None) -> torch.device:
    """``chosen`` (from ``device_map``), else the device the module was tuned on."""
    if chosen is not None:
        return chosen
    saved = {spec.device for g in entry.graphs for spec in g.graph.inputs}
    device = saved.pop() if len(saved) == 1 else "cpu"
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ArtifactError(
            f"{entry.name}: the manifest names an unknown device {device!r}; the file is corrupt"
        ) from exc
    if found.type not in FILE_DEVICES:
        raise ArtifactError(
            f"{entry.name}: the manifest names the device {device!r}; a file may only say "
            f"{' or '.join(FILE_DEVICES)} (pass device_map to choose another)"
        )
    return found


def _as_device(value: Any, where: str) -> torch.device:
    try:
        return torch.device(value)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InputError(f"{where}: {value!r} is not a device; write e.g. 'cpu' or 'cuda:0'") from exc


def _devices(manifest: Manifest, device_map: DeviceMap) -> dict[str, torch.device | None]:
    """The device of each saved module: ``device_map`` is one device, or AITune's
    ``{"<attr or child name>": device}`` where a key names a module, its path, or a part of the
    object holding it (``"unet"`` for ``unet.down.0``; the longest match wins). A key that
    matches no saved module raises, so a typo never loads onto the wrong device.
    """
    if device_map is None:
        return {e.name: None for e in manifest.modules}
    if not isinstance(device_map, Mapping):
        device = _as_device(device_map, "device_map")
        return {e.name: device for e in manifest.modules}
    wrong = [k for k in device_map if not isinstance(k, str)]
    if wrong:
        raise InputError(f"device_map keys are module names or paths (strings), got {wrong!r}")
    keys = {k: _as_device(v, f"device_map[{k!r}]") for k, v in device_map.items()}
    out: dict[str, torch.device | None] = {}
    used: set[str] = set()
    for entry in manifest.modules:
        where = entry.path if entry.path is not None else entry.name
        matches = [k for k in keys if k in (entry.name, where) or k == "" or where.startswith(k + ".")]
        best = max(matches, key=lambda k: (k == entry.name, len(k)), default=None)
        out[entry.name] = keys[best] if best is not None else None
        used.update(matches)
    unmatched = [k for k in keys if k not in used]
    if unmatched:
        saved = ", ".join(f"{e.name!r} saved {_where(e)}" for e in manifest.modules)
        raise InputError(
            f"device_map names {unmatched}, which match no saved module (the artifact holds {saved}): "
            "use a module's name, its path, or the attribute or child that holds it"
        )
    return out


def _where(entry: ModuleEntry) -> str:
    """``as the whole object`` or ``at 'unet.down.0'``: where a saved module sat."""
    return "as the whole object" if entry.path == "" else f"at {entry.path if entry.path is not None else entry.name!r}"


def _incompatible(entry: GraphEntry, device: torch.device, registry: BackendRegistry) -> str | None:
    """Why this graph's payload cannot run here, checked before any runtime sees it."""
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


@contextlib.contextmanager
def only_artifact_errors(path: Path, doing: str) -> Iterator[None]:
    """Nothing but an aitune error leaves the block (Ctrl-C excepted): a ``SystemExit`` or any other
    exception a file made a runtime raise becomes an :class:`ArtifactError` naming it."""
    try:
        yield
    except (AituneError, KeyboardInterrupt):
        raise
    except BaseException as exc:
        raise ArtifactError(
            f"{path}: {doing} stopped with {type(exc).__name__}: {exc}; the artifact is corrupt or hostile, or a "
            "runtime failed: tune and save again, or load it with fallback='eager'"
        ) from exc


@attrs.frozen
class Trust:
    """Whether native code from this artifact may run, and why."""

    native: bool
    why: str
    vouched: bool = False
    """The bytes themselves are vouched for (pinned, or signed by a trusted key), not only native code
    allowed: ``ait.load``'s ``check`` is off by default for such an artifact."""


@attrs.frozen
class Asked:
    """What the caller offered to trust an artifact by: a pin, public keys, or their word."""

    expected_sha256: str | None = None
    trusted_keys: Sequence[str | Path] | None = None
    signature: str | Path | None = None
    trust_native_code: bool = False

    def detached(self, path: Path) -> bool:
        """A detached signature beside the file (or given) may be checked over the whole file: then the
        file is read from a private copy made while hashing, so what is checked is what is parsed."""
        return bool(self.trusted_keys) and signature_path(path, self.signature).is_file()

    def judge(self, reader: Reader) -> Trust:
        """How far the artifact ``reader`` opened is trusted by what was offered; a signature that does
        not check raises.

        A trusted key is checked first against the signature inside the file (:mod:`.seal`, over the
        digest list the reader holds), then against a detached ``.sig`` on the reader's own open
        file; the pin was checked by the reader: what is trusted is what is read, whatever is at the
        path by then.
        """
        if self.trusted_keys:
            if reader.seal is not None:
                keys = [_read_public_key(Path(key)) for key in self.trusted_keys]
                index = seal.signer(reader.seal, reader.sums, keys)
                if index is not None:
                    return Trust(
                        True, f"signed inside the file by the key {Path(self.trusted_keys[index]).name}", vouched=True
                    )
                detached = signature_path(reader.path, self.signature)
                if not detached.is_file():
                    raise ArtifactError(
                        f"{reader.path} is not signed by a key you trust: its signature inside the file is by the key "
                        f"{seal.parse(reader.seal)['key']} (or the file changed since), and there is no signature at "
                        f"{detached}; get the artifact again from its source"
                    )
            why = verify_signature(
                reader.path, self.trusted_keys, signature=self.signature, content=reader.content_path()
            )
            return Trust(True, why, vouched=True)
        if self.expected_sha256 is not None:
            return Trust(True, "pinned by expected_sha256", vouched=True)
        if self.trust_native_code:
            return Trust(True, "trust_native_code=True")
        return Trust(False, "")

    def own_key(self, reader: Reader) -> Trust:
        """Trusted when signed inside the file by the user's own key (:mod:`.ownkey`): what the user
        saved loads back with no flag, wherever the file was copied."""
        if reader.seal is None or not ownkey.enabled():
            return Trust(False, "")
        own = ownkey.existing()
        if own is None:
            return Trust(False, "")
        try:
            mine = seal.signer(reader.seal, reader.sums, [own.public_pem]) is not None
        except ArtifactError:  # a malformed record: not the user's own
            mine = False
        if not mine:  # signed by someone else, or changed since
            if _names_key(reader.seal, own.public_pem):
                warnings.warn(
                    f"{reader.path} is signed by your own key ({own.public}) and was changed since it was signed: "
                    "its digest list no longer matches the signature, so it is not trusted (ait.load checks it "
                    "against eager unless check=False, and refuses native payloads); save it again from the "
                    "model if the change was yours, else get it again from where you saved it",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return Trust(False, "")
        return Trust(True, f"signed by your own key ({own.public})", vouched=True)


def _names_key(member: bytes, public_pem: bytes) -> bool:
    """The signature record says it was made by this key (what it says, not whether it checks)."""
    try:
        return bool(seal.parse(member)["key"] == seal.key_id(public_pem))
    except (ArtifactError, ValueError):
        return False


def _read_public_key(path: Path) -> bytes:
    """A trusted public key's PEM bytes (the user named the file: it is theirs to keep safe)."""
    try:
        with open(path, "rb") as file:
            data = file.read(ownkey.MAX_KEY_BYTES + 1)
    except OSError as exc:
        raise ArtifactError(f"the trusted key {path} cannot be read ({exc.strerror})") from exc
    if len(data) > ownkey.MAX_KEY_BYTES:
        raise ArtifactError(f"the trusted key {path} is larger than a public key")
    return data


def load(
    obj: Any,
    path: str | Path,
    device_map: DeviceMap = None,
    *,
    fallback: str | None = None,
    expected_sha256: str | None = None,
    trusted_keys: Sequence[str | Path] | None = None,
    signature: str | Path | None = None,
    trust_native_code: bool = False,
    freeze: bool | None = None,
    weights: str | None = None,
    check: bool | None = None,
    static_cache: bool = True,
    manager: AituneManager | None = None,
    options: LoadOptions | Mapping[str, Any] | None = None,
) -> Any:
    """Load the artifact at ``path`` into ``obj`` and return it tuned, with no build.

    ``obj`` is a freshly built model or pipeline, as AITune's ``load`` takes it: each saved
    module is wrapped in ``ait.Module`` at the path it had when saving and filled. A module that
    is already wrapped under the saved name is filled in place. When the model itself was saved
    (``ait.Module(model, ...)``), the wrapped model is returned: write ``model = ait.load(...)``.
    Every digest is checked before ``obj`` is looked at, and ``obj`` is checked whole (every
    path, every parameter and buffer shape) before anything in it changes. ``device_map`` is one
    device or ``{"<attr or child name>": device}``. ``fallback="eager"`` keeps a module whose
    payload cannot run here eager (with a warning) instead of raising.

    Loading is data only: no module is imported because the file names it, no constructor runs on
    the file's values, runtime options come from an allow-list. A payload that is native code
    (AOTInductor, TensorRT) runs only from a trusted artifact: pinned (``expected_sha256``), signed
    by one of ``trusted_keys`` (its ``.sig`` beside it, or ``signature``), or with
    ``trust_native_code=True``; otherwise it is refused, or runs eager with ``fallback="eager"``.
    Whatever goes wrong ends in an :class:`ArtifactError` (Ctrl-C excepted). ``freeze`` (default
    ``ait.config.freeze``, True) makes the tuned modules' parameters inference-only, as ``ait.tune``
    does, so plain calls run the loaded backends.

    ``weights`` says whose weights the loaded modules serve: ``"artifact"`` (the ones saved, which
    the payloads were built with: they replace the model's), or ``"model"`` (the model's own, say
    a new checkpoint loaded into ``build_model()``: the payloads are refitted with them and checked
    against eager, and a module whose payload cannot be refitted runs eager, with a warning). Left
    None, the artifact's are used, with a warning when the model's own differ.

    ``check`` runs each payload against eager with the artifact's weights four times per graph, at
    its min, opt and max sizes, on inputs drawn from the values recorded while tuning (integer ids
    through their range, masks padding some positions), and refuses one that disagrees, puts NaN or
    infinity where eager does not (or the reverse), or comes with a NaN weight eager never showed:
    an ArtifactError, or that graph eager with a warning under ``fallback="eager"``. On by default
    for an artifact that is neither pinned nor signed by a trusted key or your own (a signature
    inside the file, which ``ait.save`` makes); it costs four calls of the payload and four of eager
    per graph, one at the max sizes. It catches a wrong runtime or a stale export, not a crafted
    graph with a trigger: only a pin or a signature stops that. Payloads refitted with weights
    (``weights="model"``, a refitted artifact) are checked against eager on every size anyway.

    Every check that needs no runtime (digests, signature, manifest, devices, bounds, configs,
    trust, the object's structure) passes before anything in ``obj`` changes. With ``fallback``
    left None, a failure after that (a runtime refusing a payload, ``check``) puts the model's own
    weights, device and modules back before the error is raised: it costs a host copy of the
    weights while loading, unless they equal the artifact's (those are put back then).

    ``static_cache`` (default True): when a loaded decode step runs on a static KV cache, the
    transformers model holding it generates with one (``generation_config.cache_implementation =
    "static"`` where it was None, logged), as ``ait.tune`` set it; ``static_cache=False`` leaves it.

    ``manager``: the plugin manager whose backends read the payloads (default: the process's,
    :func:`aitune.plugins.get_manager`).

    ``options``: every option above as one :class:`~aitune.artifact.options.LoadOptions` (or a
    mapping of them, as a Serve config file holds), instead of the keyword arguments: what the
    serving engines pass on. Given with any of those keyword arguments, it is refused.
    """
    given = LoadOptions.of(
        {
            "device_map": device_map,
            "fallback": fallback,
            "expected_sha256": expected_sha256,
            "trusted_keys": trusted_keys,
            "signature": signature,
            "trust_native_code": trust_native_code,
            "freeze": freeze,
            "weights": weights,
            "check": check,
            "static_cache": static_cache,
        }
    )
    if options is not None:
        if given.changed():
            raise ValueError(
                f"ait.load got options= and {', '.join(given.changed())}: put every option in one of the two"
            )
        given = LoadOptions.of(options)
    check_switches()
    path = Path(path)
    with only_artifact_errors(path, "loading"):
        asked = Asked(given.expected_sha256, given.trusted_keys, given.signature, given.trust_native_code)
        session = (get_manager() if manager is None else manager).session()
        obj = _load(obj, path, given.device_map, given.fallback, asked, given.weights, given.check, session=session)
    if given.static_cache and any(w.graph.mutated for m in wrapped_modules(obj) for w in m.tuned_graphs):
        StaticCacheSwitch.apply(obj).settle(used=True, by="ait.load")
    if settings.freeze if given.freeze is None else given.freeze:
        freeze_tuned(obj)
    return obj


def _load(
    obj: Any,
    path: Path,
    device_map: DeviceMap,
    fallback: str | None,
    asked: Asked,
    weights: str | None = None,
    check: bool | None = None,
    *,
    session: Session,
) -> Any:
    """Every check first, then the changes: nothing in ``obj`` changes until the digests, the
    manifest, the object's structure, every device, config, bound and the trust policy passed."""
    from ..engine.wrap import place  # the wrap helpers live with ait.wrap, above this layer

    with (
        open_artifact(path, asked.expected_sha256, private=asked.detached(path)) as reader,
        tempfile.TemporaryDirectory(prefix="aitune-load-") as tmp,
    ):
        trust = asked.judge(reader)
        # each member is hashed once, on the bytes used: the manifest and the weights as they are read,
        # the rest (payloads copied into the private folder while hashed) by verify_all, all before
        # anything in obj changes
        manifest = read_manifest(reader)
        if not trust.vouched:
            own = asked.own_key(reader)
            trust = own if own.vouched else trust
        if check is None:  # on unless the bytes are vouched for: pinned, or signed by a trusted key or your own
            check = not trust.vouched
        tensors = {entry.name: _read_weights(reader, entry) for entry in manifest.modules}
        targets = _targets(obj, manifest, reader, tensors)
        devices = _devices(manifest, device_map)
        ready = {}
        for entry in manifest.modules:
            with _as_artifact_error(path, entry):
                ready[entry.name] = _check_module(
                    reader,
                    entry,
                    tensors[entry.name],
                    targets[entry.name],
                    devices[entry.name],
                    fallback,
                    session,
                    trust,
                    weights,
                )
        folders: dict[str, list[Path]] = {}
        for module in ready.values():
            for graph in module.graphs:
                folders.setdefault(graph.entry.payload, []).append(_payload_folder(Path(tmp), module.entry, graph))
        reader.verify_all(extract=folders)
        # -- every check passed: from here on the given object changes --------------------------------
        given = obj
        saved = (
            [_Saved.of(obj, entry, targets[entry.name], ready[entry.name]) for entry in manifest.modules]
            if fallback is None
            else []
        )
        try:
            for entry in sorted(manifest.modules, key=lambda e: -_depth(e)):  # children before the object itself
                target = targets[entry.name]
                if not isinstance(target, Module):
                    target = Module(target, entry.name, strict=entry.strict)
                    if entry.path:
                        place(obj, entry.path, target)
                    else:
                        obj = target
                    targets[entry.name] = target
            for entry in manifest.modules:
                with _as_artifact_error(path, entry):
                    _apply_module(reader, ready[entry.name], targets[entry.name], fallback, Path(tmp), session, check)
                object.__setattr__(targets[entry.name], "pad", dict(entry.pad))
        except BaseException:
            for kept in saved:
                try:
                    kept.restore(given)
                except Exception as exc:  # the load's own error stays the one raised
                    warnings.warn(
                        f"{path}: after the failed load, {kept.entry.name} could not be put back as it was "
                        f"({type(exc).__name__}: {exc}); build the model again",
                        RuntimeWarning,
                        stacklevel=4,
                    )
            raise
    return obj


def _has_native(manifest: Manifest, registry: BackendRegistry) -> bool:
    """Some payload in the manifest is native code (by its installed backend), so trust matters."""
    return any(
        g.backend in registry and registry.backend_class(g.backend).native_payload
        for e in manifest.modules
        for g in e.graphs
    )


@attrs.define
class _Saved:
    """A module as it was before ``ait.load`` changed it: its weights (a host copy), device and place."""

    entry: ModuleEntry
    module: torch.nn.Module
    was_wrapped: bool
    state: dict[str, torch.Tensor]
    device: torch.device | None

    @classmethod
    def of(cls, obj: Any, entry: ModuleEntry, target: Any, ready: _ReadyModule) -> _Saved:
        """``ready.weights`` stand for the module's own when they were found equal to them, dtype and
        all (:func:`_compare_weights`): then no host copy is made; they are never written to."""
        module = target.module if isinstance(target, Module) else target
        if ready.same_weights:
            state = ready.weights
        else:
            state = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
        first = next(iter(module.state_dict().values()), None)
        return cls(entry, module, isinstance(target, Module), state, first.device if first is not None else None)

    def restore(self, obj: Any) -> None:
        from ..engine.wrap import place

        if self.device is not None:
            self.module.to(self.device)
        self.module.load_state_dict(self.state, strict=False)
        if not self.was_wrapped and self.entry.path:
            with contextlib.suppress(Exception):  # the path was checked before: it holds the wrapper now
                place(obj, self.entry.path, self.module)


@contextlib.contextmanager
def _as_artifact_error(path: Path, entry: ModuleEntry) -> Iterator[None]:
    try:
        yield
    except AituneError:
        raise
    except Exception as exc:  # an inconsistent manifest that passed its schema (found by fuzzing)
        raise ArtifactError(
            f"{path}: {entry.name} cannot be loaded from this artifact ({type(exc).__name__}: {exc}); "
            "the file is corrupt or was written by an incompatible aitune: tune and save again"
        ) from exc


def _depth(entry: ModuleEntry) -> int:
    return -1 if not entry.path else entry.path.count(".")


def _targets(
    obj: Any, manifest: Manifest, reader: Reader, tensors: Mapping[str, Mapping[str, torch.Tensor]]
) -> dict[str, Any]:
    """Per saved module, what in ``obj`` receives it: its ``ait.Module``, or the plain module at its path.

    Every problem is collected first and raised as one error, so a bad object is left untouched.
    """
    from ..engine.wrap import resolve

    wrapped = {m.name: m for m in wrapped_modules(obj)}
    targets: dict[str, Any] = {}
    problems: list[str] = []
    for entry in manifest.modules:
        where = entry.path if entry.path is not None else entry.name
        target = wrapped.get(entry.name)
        if target is None:
            try:
                target = resolve(obj, where)
            except InputError as exc:
                problems.append(f"{entry.name!r} was saved {_where(entry)}, but {exc}")
                continue
            if isinstance(target, Module):
                problems.append(
                    f"{entry.name!r} was saved {_where(entry)}, where the given object has ait.Module "
                    f"{target.name!r}: give it the saved name, or pass the model unwrapped"
                )
                continue
            if not isinstance(target, torch.nn.Module):
                problems.append(
                    f"{entry.name!r} was saved {_where(entry)}, where the given object has a "
                    f"{type(target).__name__}, not a torch.nn.Module"
                )
                continue
        saved = {k: tuple(v.shape) for k, v in tensors[entry.name].items()}
        differences = _structure_differences(saved, target.module if isinstance(target, Module) else target)
        if differences:
            problems.append(
                f"{'the given object' if entry.path == '' else 'the module ' + _where(entry)} has another "
                f"structure than the saved {entry.name!r} ({differences})"
            )
            continue
        if entry.name in targets or any(t is target for t in targets.values()):
            problems.append(f"the artifact lists {entry.name!r} twice, or two modules at one path; it is corrupt")
            continue
        targets[entry.name] = target
    if problems:
        raise ArtifactError(
            f"{reader.path} does not fit the given object: " + "; ".join(problems) + ". Build the model as it was "
            "when saving (same architecture and configuration), unwrapped or wrapped with the saved names"
        )
    return targets


def _structure_differences(saved: Mapping[str, tuple[int, ...]], module: torch.nn.Module) -> str:
    """What differs between the saved weights' names and shapes and ``module``'s, or ``""``."""
    here = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    parts = []
    missing, unexpected = sorted(set(saved) - set(here)), sorted(set(here) - set(saved))
    if missing:
        parts.append(f"missing here: {_few(missing)}")
    if unexpected:
        parts.append(f"not in the artifact: {_few(unexpected)}")
    shapes = [
        f"{k} is {list(here[k])} here, {list(saved[k])} saved"
        for k in sorted(set(saved) & set(here))
        if saved[k] != here[k]
    ]
    if shapes:
        parts.append("; ".join(shapes[:5]) + (f" (and {len(shapes) - 5} more)" if len(shapes) > 5 else ""))
    return "; ".join(parts)


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")


def _read_weights(reader: Reader, entry: ModuleEntry) -> dict[str, torch.Tensor]:
    """The module's saved weights, from the bytes whose digest :meth:`Reader.read` checked."""
    from safetensors.torch import load as load_tensors  # imported on use: it costs ~75 ms at import

    try:
        return load_tensors(reader.read(entry.weights))
    except AituneError:
        raise
    except Exception as exc:
        raise ArtifactError(
            f"{reader.path}: the weights of {entry.name!r} cannot be read: not valid safetensors ({exc})"
        ) from exc


def _payload_folder(tmp: Path, entry: ModuleEntry, graph: _ReadyGraph) -> Path:
    """Where a graph's payload is copied (while its digests are checked) for its runtime to open."""
    return tmp / f"{entry.name}-{graph.index}".replace("/", "_")


@attrs.define
class _ReadyGraph:
    """One graph of a module ready to load: its manifest entry, checked, and the backend made from its config."""

    index: int
    entry: GraphEntry
    backend: Backend


@attrs.define
class _ReadyModule:
    """What loading one module will do, decided with the given object untouched: a saved decision
    checked and ready to apply (no tuning plan: nothing is built or measured)."""

    entry: ModuleEntry
    weights: dict[str, torch.Tensor]
    device: torch.device | None
    """None: the module runs eager on the CPU (its CUDA device is missing and fallback="eager")."""
    graphs: list[_ReadyGraph]
    whose: str | None
    native_trusted: bool = False
    """The bytes are trusted enough to run native payloads (their graphs were refused otherwise)."""
    same_weights: bool = False
    """The module's own weights equal these, name, dtype and value: a rollback puts these back."""


def _check_module(
    reader: Reader,
    entry: ModuleEntry,
    weights: dict[str, torch.Tensor],
    target: Any,
    chosen: torch.device | None,
    fallback: str | None,
    session: Session,
    trust: Trust,
    whose: str | None,
) -> _ReadyModule:
    """Read and check everything about ``entry``; refusals raise (or, with ``fallback="eager"``, leave
    a graph eager with a warning). Changes nothing in ``target``."""
    module = target.module if isinstance(target, Module) else target
    mismatch = _weights_mismatch(module, weights)
    if mismatch:
        raise ArtifactError(
            f"{reader.path}: the weights of {entry.name!r} do not fit the module given to load "
            f"(is it the same architecture?): {mismatch}"
        )
    device = _device_for(entry, chosen)
    if device.type == "cuda" and not torch.cuda.is_available():
        message = f"{reader.path}: {entry.name} needs a CUDA device and none is visible here"
        if fallback != "eager":
            raise ArtifactError(message + "; load it on a GPU machine, or pass fallback='eager'")
        warnings.warn(message + "; running it eager on the CPU", RuntimeWarning, stacklevel=4)
        return _ReadyModule(entry, weights, None, [], whose)
    compared = _compare_weights(module, weights) if whose is None or fallback is None else "unknown"
    same = fallback is None and compared == "same"  # no rollback copy needed then
    if whose is None and compared == "differ":
        warnings.warn(
            f"{reader.path}: the weights of {entry.name} in the given model differ from the artifact's; ait.load "
            "serves the artifact's (those its payloads were built with). Pass weights='model' to serve the model's "
            "own (refitted into the payloads and checked against eager), or weights='artifact' to say this is meant",
            RuntimeWarning,
            stacklevel=5,
        )
    registry = session.registry
    graphs = []
    for index, graph_entry in enumerate(entry.graphs):
        try:
            reason = _incompatible(graph_entry, device, registry) or _unimportable(graph_entry) or _bounds(graph_entry)
            if reason:
                raise ArtifactError(f"{entry.name} graph {index}: {reason}")
            config = registry.config_from_json(
                graph_entry.config, f"{entry.name}.graphs[{index}].config", from_file=True
            )
            backend_class = registry.backend_class(graph_entry.backend)
            if backend_class.native_payload and not trust.native:
                raise ArtifactError(
                    f"{entry.name} graph {index}: its {graph_entry.backend} payload is native code, which aitune runs "
                    "only from an artifact you trust: pass expected_sha256='<its SHA-256>', trusted_keys=[public key] "
                    "(the artifact signed with aitune sign), or trust_native_code=True"
                )
            graphs.append(_ReadyGraph(index, graph_entry, backend_class(config)))
        except ArtifactError as exc:
            if fallback != "eager" or isinstance(exc, ArtifactIntegrityError):
                raise
            warnings.warn(f"{exc}; {entry.name} runs eager for that graph", RuntimeWarning, stacklevel=4)
        except AituneError as exc:  # a config refused, a backend that cannot be made from it
            message = f"{reader.path}: {entry.name} graph {index} ({graph_entry.backend}) cannot be loaded here: {exc}"
            if fallback != "eager":
                raise ArtifactError(message) from exc
            warnings.warn(message + "; running eager for that graph", RuntimeWarning, stacklevel=4)
    return _ReadyModule(entry, weights, device, graphs, whose, trust.native, same)


def _apply_module(
    reader: Reader,
    ready: _ReadyModule,
    target: Module,
    fallback: str | None,
    tmp: Path,
    session: Session,
    check: bool = False,
) -> None:
    """Put the checked, ready module into ``target``: its weights, its device, each payload loaded, the winners."""
    entry, whose, device = ready.entry, ready.whose, ready.device
    if whose != "model":
        target.module.load_state_dict(ready.weights, strict=True)
    winners: list[Winner] = []
    built_with = None
    if device is not None:
        target.module.to(device)
        winners = _loaded_winners(reader, ready, target, device, fallback, tmp, session, check)
        built_with = {name: (t.dtype, tuple(t.shape), device) for name, t in ready.weights.items()}
    install(target, winners, None, built_with=built_with)
    if device is None:
        return
    if whose == "model" or any(g.refit for g in entry.graphs):  # payloads hold other weights than the module
        why = target.adopt_weights()
        if why is not None and target.strict:
            raise ArtifactError(
                f"{reader.path}: {entry.name} is strict and its payloads could not take the "
                f"{'model' if whose == 'model' else 'artifact'}'s weights ({why})"
            )
        if why is not None:
            warnings.warn(
                f"{reader.path}: {entry.name} runs eager: its payloads could not take the "
                f"{'model' if whose == 'model' else 'artifact'}'s weights ({why})",
                RuntimeWarning,
                stacklevel=4,
            )


def _loaded_winners(
    reader: Reader,
    ready: _ReadyModule,
    target: Module,
    device: torch.device,
    fallback: str | None,
    tmp: Path,
    session: Session,
    check: bool,
) -> list[Winner]:
    """Each ready graph's payload loaded into a backend on ``device`` (with ``fallback="eager"``, those that load)."""
    entry, whose = ready.entry, ready.whose
    winners: list[Winner] = []
    for graph in ready.graphs:
        index, graph_entry = graph.index, graph.entry
        try:
            folder = _payload_folder(tmp, entry, graph)  # copied there as verify_all checked each digest
            record = PayloadRecord(
                backend=graph_entry.backend,
                config=graph_entry.config,
                metadata=dict(graph_entry.metadata),
                files=None,
                distribution=graph_entry.distribution,
                version=graph_entry.distribution_version,
            )
            context = LoadContext(graph_entry.graph, device, dict(record.metadata), _cache(), entry.name)
            loaded = payload.read(
                record, folder, target.module, context, session, ready.native_trusted, backend=graph.backend
            )
            if check and whose != "model" and not graph_entry.refit:  # refitted ones are checked by adopt_weights
                disagreement = _disagreement(loaded, target.module, graph_entry.graph, target.masked_by)
                if disagreement is not None:
                    raise ArtifactError(
                        f"{reader.path}: {entry.name} graph {index} ({graph_entry.backend}): the payload does not "
                        f"answer as eager does with the artifact's own weights ({disagreement}); the artifact was "
                        "altered or its payload belongs to other weights: tune and save again"
                    )
            winners.append(Winner(graph_entry.graph, loaded))
        except ArtifactError as exc:
            if fallback != "eager" or isinstance(exc, ArtifactIntegrityError):
                raise
            warnings.warn(f"{exc}; {entry.name} runs eager for that graph", RuntimeWarning, stacklevel=5)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a runtime's SystemExit too: fallback="eager" keeps serving
            message = f"{reader.path}: {entry.name} graph {index} ({graph_entry.backend}) cannot be loaded here: {type(exc).__name__}: {exc}"
            if fallback != "eager":
                raise ArtifactError(message) from exc
            warnings.warn(message + "; running eager for that graph", RuntimeWarning, stacklevel=5)
    return winners


def _disagreement(
    backend: Backend, module: torch.nn.Module, graph: GraphSpec, masked_by: str | None = None
) -> str | None:
    """Why ``backend`` answers otherwise than ``module`` (eager, the artifact's weights), or None.
    ``ait.load(check=True)``: a few calls at the graph's min, opt and max sizes on inputs drawn from
    the values recorded while tuning (:func:`aitune.validation.check_loaded`), NaN and infinities
    matched position by position (padded positions of ``masked_by`` left out, for a module wrapped
    with ``compare="unmasked"``); and a NaN in the artifact's weights that eager never showed there
    is refused, since what the payload answers where that weight is used was not compared."""
    from ..engine import recording
    from ..validation import check_loaded

    with torch.no_grad(), recording.bypass():
        result = check_loaded(backend, module, graph, masked_by=masked_by)
    if result.reason is not None:
        return result.reason
    if not result.checked:
        warnings.warn(
            f"ait.load(check=True): eager refuses every input drawn from the graph's recorded shapes and values "
            f"({'; '.join(result.skipped)}), so the payload could not be compared with it; pin or sign the artifact "
            "to load it without this check",
            RuntimeWarning,
            stacklevel=7,
        )
    if not result.eager_nan:
        for name, tensor in module.state_dict().items():
            if (tensor.is_floating_point() or tensor.is_complex()) and bool(torch.isnan(tensor).any()):
                return (
                    f"the artifact's weight {name} holds NaN, which no checked call of eager showed, so what the "
                    "payload answers where it is used was not compared"
                )
    return None


def _weights_mismatch(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> str | None:
    """Why ``load_state_dict(weights, strict=True)`` would fail on ``module``, found without calling it."""
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or unexpected:
        return f"missing in the artifact: {_few(missing)}; not in the module: {_few(unexpected)}"
    for name, saved in weights.items():
        if tuple(own[name].shape) != tuple(saved.shape):
            return f"{name} is {list(own[name].shape)} here, {list(saved.shape)} saved"
        if own[name].is_floating_point() != saved.is_floating_point() and own[name].device.type != "meta":
            return f"{name} is {own[name].dtype} here, {saved.dtype} saved"
    return None


def _bounds(entry: GraphEntry) -> str | None:
    problem = graph_problem(entry.graph)
    return f"the manifest's graph is refused: {problem}" if problem else None


def _compare_weights(module: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> str:
    """How the module's own weights stand to the artifact's, in one pass: ``"differ"`` when a value or
    shape does (a new checkpoint loaded into it), ``"same"`` when its whole state is the artifact's
    exactly (names, dtypes, shapes, values, no meta tensor: putting ``weights`` back restores it as a
    copy of its own would), else ``"unknown"`` (a name missing on one side, a meta tensor, another dtype)."""
    own = module.state_dict()
    exact = own.keys() == weights.keys()
    for name, saved in weights.items():
        mine = own.get(name)
        if mine is None or mine.device.type == "meta":
            exact = False
            continue
        if mine.shape != saved.shape or not torch.equal(mine.detach(), saved.to(mine.device)):
            return "differ"
        exact = exact and mine.dtype == saved.dtype
    return "same" if exact else "unknown"


def _unimportable(entry: GraphEntry) -> str | None:
    """Why a type the graph's calls or outputs name is not loaded here (types are looked up, never imported)."""
    try:
        tree.check_types(entry.graph.structure)
        if entry.graph.output_structure is not None:
            tree.check_types(entry.graph.output_structure)
    except InputError as exc:
        return f"{exc}, so its outputs cannot be rebuilt in their own type"
    return None


def _cache() -> Path:
    from ..cachedir import cache_dir

    return cache_dir()


def manifest_of(path: str | Path) -> Manifest:
    """The artifact's manifest, its digest and format checked, without loading anything: what a server
    reads before ``ait.load`` (the threads it was tuned with, in ``environment``)."""
    path = Path(path)
    with only_artifact_errors(path, "reading the manifest"), open_artifact(path) as reader:
        return read_manifest(reader)


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


def verify(
    path: str | Path,
    expected_sha256: str | None = None,
    trusted_keys: Sequence[str | Path] | None = None,
    signature: str | Path | None = None,
    *,
    manager: AituneManager | None = None,
) -> dict[str, Any]:
    """Check every digest, the signature when keys are given, and whether each payload can run here
    (configs checked as ``ait.load`` checks them, native payloads named); what ``aitune verify`` prints.
    ``manager``: whose backends judge the payloads (default: the process's).

    The digests inside the file prove it is whole, not who wrote it: ``integrity`` says the former,
    ``trust`` the latter (pinned, signed by a trusted key, or not established).
    """
    path = Path(path)
    with only_artifact_errors(path, "checking"):
        registry = (get_manager() if manager is None else manager).registry
        return _verify(path, expected_sha256, trusted_keys, signature, registry)


def _verify(
    path: Path,
    expected_sha256: str | None,
    trusted_keys: Sequence[str | Path] | None,
    signature: str | Path | None,
    registry: BackendRegistry,
) -> dict[str, Any]:
    asked = Asked(expected_sha256, trusted_keys, signature)
    with open_artifact(path, expected_sha256, private=asked.detached(path)) as reader:
        trust = asked.judge(reader)
        reader.verify_all()
        manifest = read_manifest(reader)
        if not trust.native and _has_native(manifest, registry):
            trust = asked.own_key(reader)
    problems, native = [], []
    for entry in manifest.modules:
        device = _device_for(entry, None)
        for index, graph_entry in enumerate(entry.graphs):
            where = f"{entry.name} graph {index} ({graph_entry.backend})"
            reason = _incompatible(graph_entry, device, registry) or _unimportable(graph_entry) or _bounds(graph_entry)
            if reason is None:
                try:
                    registry.config_from_json(graph_entry.config, f"{where} config", from_file=True)
                except AituneError as exc:
                    reason = str(exc)
            if reason:
                problems.append(f"{where}: {reason}")
            elif registry.backend_class(graph_entry.backend).native_payload:
                native.append(where)
    return {
        "path": str(path),
        "integrity": "ok",
        "trust": trust.why or "not established (no expected_sha256 and no trusted key)",
        "native_payloads": native,
        "runnable_here": not problems and (trust.native or not native),
        "problems": problems
        + (
            [f"{len(native)} native payload(s) run only from a trusted artifact"] if native and not trust.native else []
        ),
    }
