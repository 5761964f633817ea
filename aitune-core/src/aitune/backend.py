"""The Backend contract: what a backend author writes.

A backend is one way to run a module for one graph. Its author writes a :class:`Backend`
subclass (``build``, ``infer``, ``save``, ``load``), a frozen attrs :class:`BackendConfig`
subclass, and a registration hook. The engine creates one backend object per (module, graph) by
cloning the object the user handed to a strategy, so user-facing objects stay reusable templates.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePath, PurePosixPath
from typing import Any, ClassVar

import attrs
import torch

from .errors import BackendNotImplementedError, BuildError, SerializationError
from .graph import GraphSpec, Sample


@attrs.frozen(kw_only=True)
class BackendConfig:
    """Base class of every backend's configuration: frozen attrs, validated, JSON through cattrs."""

    def untrusted_settings(self) -> list[str]:
        """The settings of this config that must not come from a file, each with why.

        A config read from an artifact, a cache entry or the JIT store is refused when this names
        anything: a compiler path, a library to load, a testing switch. The default trusts every
        setting; a backend whose runtime takes such options allow-lists what a file may say.
        """
        return []


@attrs.frozen(kw_only=True)
class Tolerance:
    """How far a candidate's outputs may be from eager's and still count as correct.

    An output passes when ``max|y - y_eager| <= atol + rtol * max|y_eager|`` and its cosine
    similarity with eager is at least ``min_cosine``. The error is measured against the scale of
    the whole output, so near-zero elements do not make a correct result look wrong.
    """

    atol: float = attrs.field(validator=attrs.validators.ge(0.0))
    rtol: float = attrs.field(validator=attrs.validators.ge(0.0))
    min_cosine: float = attrs.field(default=0.999, validator=[attrs.validators.ge(-1.0), attrs.validators.le(1.0)])


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(atol=1e-7, rtol=1e-5, min_cosine=0.99999),
    "float32": Tolerance(atol=1e-5, rtol=1e-3, min_cosine=0.9999),
    "float16": Tolerance(atol=1e-3, rtol=1e-2, min_cosine=0.999),
    "bfloat16": Tolerance(atol=1e-2, rtol=5e-2, min_cosine=0.99),
}
"""Bounds for floating outputs by dtype; integer and bool outputs must match exactly."""


@attrs.define
class BuildContext:
    """What a backend gets to build one graph of one module."""

    graph: GraphSpec
    samples: list[Sample]
    """Real recorded calls of this graph, on ``device``: for tracing, calibration and warm-up."""
    device: torch.device
    workdir: Path
    """A scratch folder for this build; it is removed afterwards."""
    cache_dir: Path
    """aitune's cache folder, for compiler caches that should outlive one build."""
    module_name: str = ""


@attrs.define
class LoadContext:
    """What a backend gets to load a saved payload."""

    graph: GraphSpec
    device: torch.device
    metadata: dict[str, Any]
    """What :meth:`Backend.save` returned when the payload was written."""
    cache_dir: Path
    module_name: str = ""


def torch_allows_tf32() -> bool:
    """Whether torch's process-wide flags let CUDA fp32 matmuls or cuDNN convolutions use TF32
    (``fp32_precision`` from torch 2.9, where ``"none"`` defers to the level above; the
    ``allow_tf32`` flags before)."""
    backends = torch.backends
    if hasattr(backends.cudnn, "conv") and hasattr(backends.cuda.matmul, "fp32_precision"):
        generic = backends.fp32_precision  # type: ignore[attr-defined]
        conv = backends.cudnn.conv.fp32_precision
        conv = backends.cudnn.fp32_precision if conv == "none" else conv
        matmul = backends.cuda.matmul.fp32_precision
        return "tf32" in (
            generic if conv == "none" else conv,
            generic if matmul == "none" else matmul,
        )
    return bool(backends.cuda.matmul.allow_tf32 or backends.cudnn.allow_tf32)


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity, else ``os.cpu_count()``).

    Thread counts a config gives a runtime are capped at this: a count read from a file
    (``intra_op_num_threads=2000``) must not start thousands of threads, and more threads than
    cores never ran faster.
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def payload_file(directory: Path, name: Any) -> Path:
    """``directory / name`` for a file name a payload's metadata gives, refused unless it stays inside.

    Metadata comes from a file: a name that is absolute, climbs out (``..``) or is not a plain
    relative path would let an artifact load something from elsewhere on the machine.
    """
    path = PurePosixPath(name) if isinstance(name, str) else None
    if (
        path is None
        or not path.parts
        or path.is_absolute()
        or "\\" in name
        or any(p in ("", ".", "..") for p in path.parts)
    ):
        raise SerializationError(f"the payload names the file {name!r}, which is not a plain path inside the payload")
    return Path(directory).joinpath(*path.parts)


EXPORT_S = "export_s"
"""``build_info`` key: seconds of the build spent exporting the module (0 when another candidate's export was reused)."""
WAIT_S = "wait_s"
"""``build_info`` key: seconds of the build spent waiting for a build that ran elsewhere (submitted ahead)."""


class Backend(abc.ABC):
    """One way to run a module for one graph.

    Subclasses set ``name`` (the registry name), ``config_class`` and, when not both CPU and CUDA,
    ``devices``, and implement ``build``, ``infer``, ``save`` and ``load``; the plugin's
    ``BackendSpec`` takes these three from the class. ``build`` must leave the module it is given unchanged: copy
    it first if a transformation works in place. ``build_info`` is for JSON-able facts the backend
    wants in the tuning report (graph breaks, providers, whether a load compiled anything); a build
    that exports first states the export's seconds under :data:`EXPORT_S`, which the report's time
    breakdown counts as export rather than build.
    """

    name: ClassVar[str] = ""
    config_class: ClassVar[type[BackendConfig]] = BackendConfig
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    """Device types this backend runs on; a device the machine lacks is reported unavailable."""
    native_build: ClassVar[bool] = False
    """True when building compiles native code that may crash the process (isolated by default)."""
    native_payload: ClassVar[bool] = False
    """True when the saved payload is native code the runtime executes (an AOTInductor package's
    shared library, a TensorRT plan): ``ait.load`` runs it only from a trusted artifact (pinned,
    signed by a trusted key, or ``trust_native_code=True``)."""
    compiles_anything: ClassVar[bool] = False
    """True for a backend that builds almost any module (a tracing JIT compiler): strategies that try
    backends in turn, like JIT mode's default, try it after the exporting ones."""
    retry_in_process: ClassVar[bool] = False
    """True when a build that failed in the isolated worker (a crash, an exit or an error; not a time
    or memory limit) is worth one more try in the user's process, because the in-process build takes
    another path (AOTInductor compiles the live exported program; the worker one that went through
    ``torch.export.save``/``load``). Validation judges the retry as any build."""
    build_cost: ClassVar[float] = 1.0
    """What one build costs, relative to an export plus a runtime session (ONNX Runtime, torchao: 1);
    compilers that generate and search kernels say more (Inductor 4-6, TensorRT 10). Under
    ``ait.tune(time_budget=...)`` cheaper candidates are built first."""
    mutates_inputs: ClassVar[bool] = False
    """True when ``infer`` updates the inputs the module updates in place (a static KV cache's
    tensors), as eager does. A graph with such inputs (``GraphSpec.mutated``) is built only by a
    backend that says so; the others are skipped for it with the reason."""

    warm_imports: ClassVar[tuple[str, ...]] = ()
    """Modules this backend imports on first use (its runtime, its submodules, the torch internals
    its build runs). Background JIT tuning imports them when it is switched on, before the program
    serves, so no serving call waits while a tuner thread imports them (:mod:`aitune.engine.jit.preload`)."""

    builds_static: ClassVar[bool] = False
    """True when a build for a graph whose every axis is one size (a batch range ``b..b``) compiles
    for those shapes alone, which may run faster than the dynamic build (AOTInductor, ONNX
    Runtime). ``MaxThroughputStrategy(static_shapes=True)`` then tries such a build per batch size
    where this backend serves, and keeps it only where it clearly pays."""

    def __init__(self, config: BackendConfig | None = None) -> None:
        if config is None:
            config = self.config_class()
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = config
        self.build_info: dict[str, Any] = {}

    def clone(self) -> Backend:
        """A fresh, unbuilt backend with the same configuration."""
        return type(self)(self.config)

    def tolerance(self, dtype: torch.dtype) -> Tolerance | None:
        """This backend's own bound for outputs of ``dtype``, or None for the dtype's default.

        Quantizing backends return a looser bound here.
        """
        return None

    def computes_tf32(self) -> bool:
        """Whether this candidate may compute fp32 matmuls or convolutions in TF32 on a GPU. Then
        its fp32 bound on a GPU is TF32's and validation leaves torch's TF32 flags as they are for
        the eager reference; otherwise the reference runs in full fp32. By default a backend runs
        torch's own kernels and follows torch's flags; a compiler says what it builds."""
        return torch_allows_tf32()

    @classmethod
    def default_configs(cls) -> Sequence[BackendConfig]:
        """The configs this backend is tried with as a default candidate, each one its own candidate.

        One by default. A backend whose best config depends on the model (which exporter, which
        kernel) lists the cheap-to-build variants, so the tuner measures instead of guessing.
        """
        return [cls.config_class()]

    @classmethod
    def quantized_configs(cls) -> Sequence[BackendConfig]:
        """Configs that trade accuracy for speed (int8), tried as default candidates only when the
        user gave an accuracy budget (``ait.tune(..., metric=..., accuracy_budget=...)``). None by default."""
        return []

    def variant(self) -> str | None:
        """A few words naming this config among the backend's variants (``"torchscript export"``), or None."""
        return None

    def superseded_by(self, device: torch.device) -> tuple[str, ...]:
        """Registry names of backends that run what this build would run on ``device``, with less
        work around each call (AOTInductor for ``torch.compile`` on the CPU). Among a strategy's
        default candidates this one is built after them and not at all when one of them built and
        passed validation for the graph: its build could not win, only cost time. Listing backends
        in the strategy builds every one listed. None by default."""
        return ()

    def follows_weights(self) -> bool:
        """True when ``infer`` reads the module's own weight tensors at each call, so it follows
        ``load_state_dict`` and in-place updates; False (the default) when build or load copies the
        weights into an engine. A tuned module whose baked weights changed is refitted (:meth:`refit`),
        else runs eager."""
        return False

    def refit(self, weights: Mapping[str, torch.Tensor]) -> bool:
        """Load new weights into the built payload in place, without rebuilding; True when it could.

        ``weights`` is the module's ``state_dict()`` (its own names, the module's device). Called
        when the weights of a module this backend serves changed (``load_state_dict``, ``.to()``,
        an edit seen at ``eval()``) and by ``ait.load(..., weights="model")``; core then checks the
        refitted backend against eager before serving it again, so a weight the payload folded
        away and could not update is caught. Set ``build_info["refitted"] = True`` when you did:
        ``save`` then tells ``load`` to refit the payload with the artifact's weights. The default
        cannot (False): the module runs eager, with a warning, until it is tuned again.
        """
        return False

    def unsupported_reason(self, graph: GraphSpec, device: torch.device) -> str | None:
        """Why this backend cannot handle ``graph`` on ``device``, checked before any build."""
        return None

    @abc.abstractmethod
    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        """Compile or convert ``module`` for ``context.graph``; afterwards ``infer`` works."""

    @abc.abstractmethod
    def infer(self, *args: Any, **kwargs: Any) -> Any:
        """Run one call, with the module's own calling convention and output structure."""

    def runs_host_arrays(self) -> bool:
        """True when :meth:`infer_host` runs this built payload. A server holds a request's inputs as
        numpy arrays; a backend whose runtime takes them as they are (ONNX Runtime on the CPU) answers
        without a torch tensor made on either side, which saves microseconds per torch call in a busy
        server (:mod:`aitune.engine.host`). False by default."""
        return False

    def infer_host(self, arrays: Sequence[Any]) -> list[Any]:
        """Run one call on host numpy arrays: the graph's flat inputs in its input order, each in the
        graph's dtype and in a shape it was tuned for; returns its flat outputs, as numpy arrays in
        the order of the graph's output structure. Only called where :meth:`runs_host_arrays` says so."""
        raise BackendNotImplementedError(f"backend {self.name!r} does not run on host arrays")

    def save(self, directory: Path) -> dict[str, Any]:
        """Write the payload into ``directory``; return JSON-able metadata that ``load`` gets back."""
        raise SerializationError(f"backend {self.name!r} cannot be saved")

    def load(self, module: torch.nn.Module, directory: Path, context: LoadContext) -> None:
        """Restore from a payload written by ``save``; afterwards ``infer`` works without a build."""
        raise SerializationError(f"backend {self.name!r} cannot be loaded")

    # -- isolated builds (optional) ------------------------------------------------------------
    #
    # A backend whose compiler may crash the process can split its build in two: ``export`` runs
    # in the user's process and writes plain files (an ONNX model, an exported program) into a
    # folder; ``build_exported`` runs in a separate worker process on those files alone (never on
    # a pickled module) and writes the payload that ``save`` would write; the user's process then
    # ``load`` s that payload. Backends that do not implement ``export`` build in-process.

    def export(self, module: torch.nn.Module, context: BuildContext, directory: Path) -> dict[str, Any] | None:
        """Write what a worker needs to build into ``directory``; return JSON-able notes, or None
        when this backend cannot build in a worker."""
        return None

    @classmethod
    def build_exported(
        cls, config: BackendConfig, exported: Path, notes: dict[str, Any], context: BuildContext, payload: Path
    ) -> dict[str, Any]:
        """In a worker process: turn ``exported`` into a payload in ``payload``; return the metadata
        ``load`` expects (as ``save`` would)."""
        raise BackendNotImplementedError(f"backend {cls.name!r} does not build in a worker")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.infer(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"


def exported_file(exported: Path, notes: dict[str, Any], key: str, default: str | None = None) -> Path:
    """The file ``notes[key]`` names inside ``exported``, for ``build_exported``.

    A worker trusts no path from the notes: only a plain file name that exists there is accepted.
    """
    name = notes.get(key, default)
    if not isinstance(name, str) or PurePath(name).name != name or name in ("", ".", ".."):
        raise BuildError(f"the export notes name {key} {name!r}, which is not a plain file name")
    path = Path(exported) / name
    if not path.is_file():
        raise BuildError(f"the exported {key} {name} is missing from {exported}; the export did not finish")
    return path
