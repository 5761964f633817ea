"""The Torch-TensorRT backends: torch.compile (JIT) and torch.export + Torch-TensorRT (AOT).

torch_tensorrt is imported only inside methods that run after the runtime check: importing it
loads TensorRT's native libraries, which must never happen while listing backends.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from aitune.plugin import (
    DEFAULT_TOLERANCES,
    Backend,
    BackendConfig,
    BackendUnavailableError,
    BuildContext,
    BuildError,
    GraphSpec,
    LoadContext,
    Sample,
    SerializationError,
    Tolerance,
    exported_file,
    torch_allows_tf32,
    tree,
)

from .archive import check_pt2_archive, load_exported_program
from .config import (
    TorchTensorRTAotBackendConfig,
    TorchTensorRTConfig,
    TorchTensorRTJitBackendConfig,
    check_known_settings,
    to_torch_tensorrt_kwargs,
)
from .shapes import (
    dynamic_ranges,
    export_program,
    mark_dynamic,
    tensorrt_inputs,
    unexportable_reason,
    warmup_samples,
)
from .versions import install_hint, runtime_problem

TF32_TOLERANCE = Tolerance(atol=1e-4, rtol=5e-3, min_cosine=0.9999)
"""fp32 outputs of TF32 layers (10 mantissa bits): the bound when ``tf32=True``."""

PROGRAM_FILE = "program.pt2"
EXPORTED_FILE = "exported.pt2"
"""The plain exported program an isolated build hands its worker (scratch, never part of a payload)."""
CALIBRATION_FILE = "calibration.safetensors"
"""The recorded calls autocast calibrates on, handed to an isolated build's worker (scratch too)."""


def require_runtime(backend: str, device: torch.device) -> None:
    """Raise :class:`BackendUnavailableError` saying why ``backend`` cannot build on ``device`` here."""
    problem = runtime_problem()
    if problem is None and device.type != "cuda":
        problem = f"Torch-TensorRT runs on CUDA devices only, not {device.type}"
    if problem is None and not torch.cuda.is_available():
        problem = "no CUDA device is visible to torch"
    if problem:
        raise BackendUnavailableError(f"backend {backend!r} cannot run here: {problem}")


def import_torch_tensorrt(backend: str) -> ModuleType:
    """Import torch_tensorrt (registers its torch.compile backend, ops and engine class)."""
    try:
        import torch_tensorrt
    except Exception as exc:  # an ABI mismatch surfaces as OSError or ImportError from a native library
        raise BackendUnavailableError(
            f"backend {backend!r} cannot import torch_tensorrt ({type(exc).__name__}: {exc}); reinstall it with: "
            f"{install_hint()}"
        ) from exc
    return torch_tensorrt


def compile_and_warm(
    module: torch.nn.Module,
    graph: GraphSpec,
    samples: list[Sample],
    backend: str | Callable[..., Any],
    options: dict[str, Any] | None = None,
) -> Callable[..., Any]:
    """``torch.compile`` ``module`` and run every warm-up call, so no compile is left for later calls.

    The first call carries the graph's dynamic axes and bounds (``mark_dynamic``), so one compiled
    graph covers the whole range; sizes 0 and 1, which torch.compile specialises, are compiled by
    the min-shape call. Warm-up runs under ``torch.no_grad()``, since grad mode is part of what a
    compiled graph is guarded on: later calls must run under it too.
    """
    compiled = torch.compile(module, backend=backend, options=options)
    calls = warmup_samples(graph, samples)
    calls[0] = mark_dynamic(graph, calls[0])
    with torch.no_grad():
        for call in calls:
            compiled(*call.args, **call.kwargs)
    return compiled


def tensorrt_engines(compiled: Any) -> int:
    """The TensorRT engines in what Torch-TensorRT's backend returned: Torch-TensorRT names each
    converted part ``_run_on_acc_<i>`` and runs it in a ``TorchTensorRTModule`` (or
    ``PythonTorchTensorRTModule``). Under distributed tracing (from 2.12, on by itself when the
    world size is above 1) and for graphs with higher-order ops, the backend returns an
    ``aot_autograd`` function, whose forward compiler made the module: it is found there."""
    return sum(_engines_in(m) for m in compiled_modules(compiled))


def _engines_in(module: torch.nn.Module) -> int:
    return sum(n.startswith("_run_on_acc") or "TensorRT" in type(c).__name__ for n, c in module.named_children())


_WALK_LIMIT = 4096
"""Objects looked at when searching a compiled function for its modules (a bound, not a depth)."""


def compiled_modules(compiled: Any) -> list[torch.nn.Module]:
    """The ``torch.nn.Module`` objects ``compiled`` is or runs: itself, or those reachable from a
    compiled function through its closures, ``functools.partial`` and ``__wrapped__`` links, bound
    methods and the attributes of the wrapper objects on the way (``aot_autograd`` keeps the forward
    compiler's module a few closures deep). Modules are not searched further; each counts once."""
    if isinstance(compiled, torch.nn.Module):
        return [compiled]
    found: dict[int, torch.nn.Module] = {}
    seen: set[int] = set()
    stack: list[Any] = [compiled]
    while stack and len(seen) < _WALK_LIMIT:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _NOT_WALKED):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            found.setdefault(id(obj), obj)
            continue
        stack.extend(_links(obj))
    return list(found.values())


_NOT_WALKED = (str, bytes, int, float, bool, type(None), type, types.ModuleType, torch.Tensor, torch.dtype)


def _links(obj: Any) -> list[Any]:
    """What a compiled function or its wrappers hold that may lead to the compiled module."""
    links: list[Any] = []
    if isinstance(obj, functools.partial):
        links += [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, types.MethodType):
        links += [obj.__func__, obj.__self__]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        links += list(obj)
    elif isinstance(obj, dict):
        links += list(obj.values())
    if isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                links.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    wrapped = getattr(obj, "__wrapped__", None) if not isinstance(obj, (list, tuple, dict)) else None
    if wrapped is not None:
        links.append(wrapped)
    if not isinstance(obj, (types.FunctionType, functools.partial, list, tuple, set, frozenset, dict)):
        attributes = getattr(obj, "__dict__", None)
        if isinstance(attributes, dict):
            links += list(attributes.values())
    return links


class EngineCounter:
    """A ``torch.compile`` backend: Torch-TensorRT's own on every graph Dynamo hands over (one per
    graph break or recompile), counting the TensorRT engines in what it returns.

    When no node converts, or fewer than ``min_block_size`` do, Torch-TensorRT's ``compile_module``
    returns the graph unchanged with a warning and no exception, so ``pass_through_build_failures``
    does not catch it: counting is how a build learns it would run eager under a TensorRT name.
    """

    def __init__(self, tensorrt_backend: Callable[..., Any]) -> None:
        self.tensorrt_backend = tensorrt_backend
        self.graphs = 0
        self.engines = 0
        self.torch_parts = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        compiled = self.tensorrt_backend(gm, example_inputs, **kwargs)
        self.graphs += 1
        modules = compiled_modules(compiled)
        self.engines += sum(_engines_in(m) for m in modules)
        self.torch_parts += sum(n.startswith("_run_on_gpu") for m in modules for n, _ in m.named_children())
        return compiled


def compile_counting(
    module: torch.nn.Module,
    graph: GraphSpec,
    samples: list[Sample],
    tensorrt_backend: Callable[..., Any],
    options: dict[str, Any],
) -> tuple[Callable[..., Any], EngineCounter]:
    """:func:`compile_and_warm` through an :class:`EngineCounter`; no TensorRT engine in any graph is a BuildError."""
    counter = EngineCounter(tensorrt_backend)
    compiled = compile_and_warm(module, graph, samples, counter, options)
    if counter.engines == 0:
        raise BuildError(
            f"Torch-TensorRT converted no part of the {counter.graphs} graph(s) torch.compile gave it to TensorRT "
            f"(no node converts, or fewer than min_block_size={options.get('min_block_size')} do; its log names the "
            "unsupported ops), so the candidate would run eager under a TensorRT name; lower min_block_size, "
            "or use another backend"
        )
    return compiled, counter


def _tolerance(config: TorchTensorRTConfig, dtype: torch.dtype) -> Tolerance | None:
    """fp32 outputs computed with fp16/bf16 (or TF32) kernels get the looser bound of that precision.

    The bound follows the precision the engine is built in: ``compile_settings`` casts the graph
    to the low type (or passes it as the release's precision setting) and refuses settings the
    installed release would ignore, so a looser bound never covers an fp32 engine.
    """
    lowest = config.lowest_precision
    if dtype == torch.float32 and lowest != torch.float32:
        return DEFAULT_TOLERANCES[str(lowest).removeprefix("torch.")]
    if dtype == torch.float32 and config.tf32:
        return TF32_TOLERANCE
    return None


def known_settings(torch_tensorrt: ModuleType) -> frozenset[str] | None:
    """The names of the installed release's ``CompilationSettings`` (None when it cannot be read)."""
    import dataclasses

    try:
        return frozenset(f.name for f in dataclasses.fields(torch_tensorrt.dynamo.CompilationSettings))
    except (AttributeError, TypeError):
        return None


def compile_settings(torch_tensorrt: ModuleType, config: TorchTensorRTConfig, jit: bool = False) -> dict[str, Any]:
    """The compile settings for the installed release, each one known to it (``jit``: for torch.compile)."""
    version = str(torch_tensorrt.__version__)
    kwargs = to_torch_tensorrt_kwargs(config, version, jit)
    check_known_settings(kwargs, known_settings(torch_tensorrt), version)
    return kwargs


def _unsupported_device(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"Torch-TensorRT runs on CUDA devices only, not {device.type}"
    return None


def _timing_cache(cache_dir: Path) -> str:
    folder = cache_dir / "torch_tensorrt"
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / "timing_cache.bin")


class _TorchTensorRTBackend(Backend):
    """What both Torch-TensorRT backends share: the compile settings and the bound they imply."""

    build_cost = 10.0  # TensorRT times kernel tactics for every converted subgraph
    warm_imports = ("torch_tensorrt", "torch_tensorrt.dynamo", "torch.export")
    config: TorchTensorRTJitBackendConfig | TorchTensorRTAotBackendConfig

    @property
    def compile_config(self) -> TorchTensorRTConfig:
        return self.config.compile_config

    def tolerance(self, dtype: torch.dtype) -> Tolerance | None:
        return _tolerance(self.compile_config, dtype)

    def computes_tf32(self) -> bool:
        """TF32 layers when ``tf32`` is on; and the parts left to PyTorch follow torch's own flags."""
        return self.compile_config.tf32 or (self.build_info.get("pytorch_subgraphs", 0) > 0 and torch_allows_tf32())


class TorchTensorRTJitBackend(_TorchTensorRTBackend):
    """``torch.compile(module, backend="torch_tensorrt")``: unsupported parts stay in PyTorch.

    Compiled code lives only in this process, so ``save`` keeps the configuration only and
    ``load`` compiles again, on inputs generated from the graph's shapes.
    """

    name = "torch_tensorrt_jit"
    config_class = TorchTensorRTJitBackendConfig

    def __init__(self, config: TorchTensorRTJitBackendConfig | None = None) -> None:
        super().__init__(config)
        self._compiled: Callable[..., Any] | None = None

    def unsupported_reason(self, graph: GraphSpec, device: torch.device) -> str | None:
        return _unsupported_device(device)

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        require_runtime(self.name, context.device)
        self._compile(module, context.graph, context.samples, context.device, context.cache_dir)
        self.build_info["load_compiles"] = True

    def _compile(
        self, module: torch.nn.Module, graph: GraphSpec, samples: list[Sample], device: torch.device, cache: Path
    ) -> None:
        torch_tensorrt = import_torch_tensorrt(self.name)
        options = compile_settings(torch_tensorrt, self.compile_config, jit=True)
        options.update(device=device, timing_cache_path=_timing_cache(cache))
        registered = torch._dynamo.lookup_backend("torch_tensorrt")  # importing torch_tensorrt registered it
        self._compiled, counter = compile_counting(module, graph, samples, registered, options)
        self.build_info.update(
            torch_tensorrt=str(torch_tensorrt.__version__),
            dynamic_dims={n: [r.min, r.opt, r.max] for n, r in dynamic_ranges(graph).items()},
            tensorrt_subgraphs=counter.engines,
            pytorch_subgraphs=counter.torch_parts,
            compiled_graphs=counter.graphs,
        )

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            raise RuntimeError(f"{self.name} used before build() or load()")
        with torch.no_grad():  # as in the warm-up, so grad mode never triggers a recompile
            return self._compiled(*args, **kwargs)

    def save(self, directory: Path) -> dict[str, Any]:
        return {"form": "config-only", "note": "torch.compile output cannot be saved; load compiles again"}

    def load(self, module: torch.nn.Module, directory: Path, context: LoadContext) -> None:
        require_runtime(self.name, context.device)
        example = context.graph.example("opt")
        self._compile(module, context.graph, [example], context.device, context.cache_dir)
        self.build_info["load_compiles"] = True


class TorchTensorRTAotBackend(_TorchTensorRTBackend):
    """torch.export with the graph's dynamic dims, compiled by ``torch_tensorrt.dynamo.compile``.

    Saved as a torch.export ``.pt2`` archive with the TensorRT engines inside; loading checks the
    archive holds nothing that would be unpickled, then ``torch.export.load`` restores it with no
    recompilation. An isolated build splits ``build`` in two: ``export`` saves the plain exported
    program, ``build_exported`` compiles it in a worker into the archive ``save`` would write.
    """

    name = "torch_tensorrt_aot"
    config_class = TorchTensorRTAotBackendConfig
    native_build = True
    native_payload = True  # the exported program carries serialized TensorRT engines

    def __init__(self, config: TorchTensorRTAotBackendConfig | None = None) -> None:
        super().__init__(config)
        self._program: Callable[..., Any] | None = None
        self._graph: GraphSpec | None = None
        self._facts: dict[str, Any] = {}

    def unsupported_reason(self, graph: GraphSpec, device: torch.device) -> str | None:
        return _unsupported_device(device) or unexportable_reason(graph)

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        require_runtime(self.name, context.device)
        program = self._export(module, context)
        self._program, self._facts = _compile_program(
            program, self.compile_config, context, calibration_batches(context.samples)
        )
        self._graph = context.graph
        with torch.no_grad():
            for call in warmup_samples(context.graph, context.samples):
                self.infer(*call.args, **call.kwargs)
        self.build_info.update(self._facts, load_compiles=False)

    # -- isolated builds: torch.export here, Torch-TensorRT in a worker, load its archive here ----

    def export(self, module: torch.nn.Module, context: BuildContext, directory: Path) -> dict[str, Any]:
        """``torch.export`` in this process, saved with ``torch.export.save`` for the worker to compile.

        Needs neither Torch-TensorRT nor a GPU beyond the module's own device.
        """
        program = self._export(module, context)
        torch.export.save(program, Path(directory) / EXPORTED_FILE)
        notes: dict[str, Any] = {"program": EXPORTED_FILE, "dynamic_dims": _dims(context.graph)}
        batches = calibration_batches(context.samples) if self.compile_config.lowest_precision != torch.float32 else []
        if batches:
            save_file(
                # copies: a call recorded twice shares its tensors, which safetensors refuses to write
                {f"{i}.{j}": t.detach().to("cpu", copy=True) for i, b in enumerate(batches) for j, t in enumerate(b)},
                str(Path(directory) / CALIBRATION_FILE),
            )
            notes["calibration"] = {"file": CALIBRATION_FILE, "batches": len(batches), "tensors": len(batches[0])}
        return notes

    @classmethod
    def build_exported(
        cls,
        config: BackendConfig,
        exported: Path,
        notes: dict[str, Any],
        context: BuildContext,
        payload: Path,
    ) -> dict[str, Any]:
        """In the worker: Torch-TensorRT compiles the exported program; the archive ``save`` writes goes to ``payload``.

        ``torch.export.load`` may unpickle parts of the program; the file is the one ``export``
        wrote moments ago into aitune's own scratch folder, never one read from an artifact.
        """
        if not isinstance(config, TorchTensorRTAotBackendConfig):
            raise TypeError(f"{cls.__name__} builds from a TorchTensorRTAotBackendConfig, got {type(config).__name__}")
        require_runtime(cls.name, context.device)
        program = torch.export.load(exported_file(exported, notes, "program", EXPORTED_FILE))
        compiled, facts = _compile_program(
            program, config.compile_config, context, _read_calibration(exported, notes, context)
        )
        metadata = _save_program(cls.name, compiled, Path(payload) / PROGRAM_FILE)
        return {**metadata, "build": facts}

    def _export(self, module: torch.nn.Module, context: BuildContext) -> torch.export.ExportedProgram:
        reason = _unsupported_device(context.device)
        if reason:
            raise BackendUnavailableError(f"backend {self.name!r} cannot run here: {reason}")
        reason = unexportable_reason(context.graph)
        if reason:
            raise BuildError(f"{self.name}: {reason}")
        if not context.samples:
            raise BuildError(f"{self.name}: torch.export needs one recorded sample to trace the module; none was given")
        return export_program(module, context.graph, context.samples[0])

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        if self._program is None or self._graph is None:
            raise RuntimeError(f"{self.name} used before build() or load()")
        with torch.no_grad():
            out = self._program(*args, **kwargs)
        if self._graph.output_structure is None:
            return out
        return self._graph.unflatten_outputs(tree.flatten(out)[0])

    def save(self, directory: Path) -> dict[str, Any]:
        if self._program is None:
            raise SerializationError(f"{self.name}: nothing to save before build()")
        return {**_save_program(self.name, self._program, directory / PROGRAM_FILE), "build": self._facts}

    def load(self, module: torch.nn.Module, directory: Path, context: LoadContext) -> None:
        require_runtime(self.name, context.device)
        import_torch_tensorrt(self.name)  # registers tensorrt::execute_engine and the engine class
        file = str(context.metadata.get("file", PROGRAM_FILE))
        if Path(file).name != file:
            raise SerializationError(f"{self.name}: payload file name {file!r} must be a plain file name")
        program = load_exported_program((directory / file).read_bytes())
        self._program = program.module()
        self._graph = context.graph
        self._facts = dict(context.metadata.get("build") or {})
        self.build_info.update(self._facts, load_compiles=False)


def _dims(graph: GraphSpec) -> dict[str, list[int]]:
    return {n: [r.min, r.opt, r.max] for n, r in dynamic_ranges(graph).items()}


def _compile_program(
    program: torch.export.ExportedProgram,
    config: TorchTensorRTConfig,
    context: BuildContext,
    calibration: list[tuple[torch.Tensor, ...]],
) -> tuple[torch.fx.GraphModule, dict[str, Any]]:
    """``torch_tensorrt.dynamo.compile`` for the graph's shape ranges; the module and facts for the report.

    ``calibration``: recorded calls for autocast to measure each node's output range on, so nodes
    whose values overflow the low type stay in fp32 (what Torch-TensorRT's data-range rule needs).
    """
    torch_tensorrt = import_torch_tensorrt(TorchTensorRTAotBackend.name)
    arg_inputs, kwarg_inputs = tensorrt_inputs(context.graph, torch_tensorrt.Input)
    settings = compile_settings(torch_tensorrt, config)
    notes = {}
    if settings.get("enable_autocast"):  # said, so a reader of the report knows what the rules saw
        extra, notes["autocast_calibration"] = autocast_calibration(calibration, known_settings(torch_tensorrt))
        settings.update(extra)
    compiled = torch_tensorrt.dynamo.compile(
        program,
        arg_inputs=list(arg_inputs),
        kwarg_inputs=kwarg_inputs or None,
        device=context.device,
        timing_cache_path=_timing_cache(context.cache_dir),
        **settings,
    )
    children = list(compiled.named_children())
    engines = tensorrt_engines(compiled)
    if engines == 0:
        raise BuildError(
            "Torch-TensorRT converted no part of the graph to TensorRT (every node runs in PyTorch), so the "
            "candidate would run eager under a TensorRT name; see the Torch-TensorRT log for the unsupported ops"
        )
    return compiled, {
        **notes,
        "torch_tensorrt": str(torch_tensorrt.__version__),
        "dynamic_dims": _dims(context.graph),
        "tensorrt_subgraphs": engines,
        "pytorch_subgraphs": sum(n.startswith("_run_on_gpu") for n, _ in children),
    }


def calibration_batches(samples: list[Sample]) -> list[tuple[torch.Tensor, ...]]:
    """The recorded calls autocast can calibrate on: positional tensors only, all of one shape.

    Torch-TensorRT runs its lowered graph on each batch's tensors as its flat inputs, which are the
    positional ones in order, and concatenates each node's outputs over the batches along axis 0,
    so calls of another shape are left out (the most common shape is kept).
    """
    usable = [
        tuple(s.args) for s in samples if not s.kwargs and s.args and all(isinstance(a, torch.Tensor) for a in s.args)
    ]
    groups: dict[tuple[tuple[int, ...], ...], list[tuple[torch.Tensor, ...]]] = {}
    for batch in usable:
        groups.setdefault(tuple(tuple(t.shape) for t in batch), []).append(batch)
    return max(groups.values(), key=len) if groups else []


def autocast_calibration(
    batches: list[tuple[torch.Tensor, ...]], known: frozenset[str] | None
) -> tuple[dict[str, Any], str]:
    """The compile setting that hands autocast ``batches`` (if the release takes one), and the report's note."""
    if known is not None and "autocast_calibration_dataloader" not in known:
        return {}, "none: this Torch-TensorRT release takes no autocast calibration data"
    if not batches:
        return {}, (
            "none: no recorded call passes positional tensors only, which is what Torch-TensorRT's autocast "
            "calibrates on; its data-range rule kept no node in fp32, the check against eager guards it"
        )
    # a list is a map-style dataset; batch_size=None hands each recorded call over as it was recorded
    loader: torch.utils.data.DataLoader[Any] = torch.utils.data.DataLoader(batches, batch_size=None)  # type: ignore[arg-type]
    shapes = [list(t.shape) for t in batches[0]]
    return {"autocast_calibration_dataloader": loader}, f"{len(batches)} recorded call(s) of shapes {shapes}"


def _read_calibration(exported: Path, notes: dict[str, Any], context: BuildContext) -> list[tuple[torch.Tensor, ...]]:
    """The calibration batches ``export`` saved (safetensors: no pickle), on the build's device."""
    facts = notes.get("calibration")
    if not facts:
        return []
    tensors = load_file(str(exported_file(exported, facts, "file", CALIBRATION_FILE)), device=str(context.device))
    return [tuple(tensors[f"{i}.{j}"] for j in range(int(facts["tensors"]))) for i in range(int(facts["batches"]))]


def _save_program(backend: str, program: Any, path: Path) -> dict[str, Any]:
    """Write ``program`` as a torch.export archive aitune can load without unpickling; its metadata."""
    import torch_tensorrt

    torch_tensorrt.save(program, str(path), output_format="exported_program", retrace=False)
    try:
        check_pt2_archive(path.read_bytes())
    except SerializationError as exc:
        path.unlink()
        raise SerializationError(
            f"{backend}: torch_tensorrt {torch_tensorrt.__version__} wrote an archive aitune could not load "
            f"safely: {exc}"
        ) from exc
    return {"file": PROGRAM_FILE, "format": "torch.export pt2", "torch_tensorrt": str(torch_tensorrt.__version__)}
