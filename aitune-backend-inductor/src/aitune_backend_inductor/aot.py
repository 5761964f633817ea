"""TorchInductorAotBackend: ``torch.export`` + AOTInductor, a ``.pt2`` package that loads without compiling."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

import torch

from aitune.plugin import (
    EXPORT_S,
    INDUCTOR_MODULES,
    Backend,
    BackendConfig,
    BuildContext,
    BuildError,
    FlatModule,
    GraphSpec,
    LoadContext,
    Sample,
    SerializationError,
    exclusive,
    exported_file,
    inductor_cache,
    inductor_options,
    owned_folder,
    resize,
)

from .config import TorchInductorAotBackendConfig, capped_options
from .package import check_archive, open_package
from .roundtrip import compiler_ranges, import_modules, operator_modules, restore_ranges
from .shapes import export_dynamic_shapes, trace_sizes

PACKAGE = "model.pt2"
EXPORTED = "program.pt2"
"""The exported program an isolated build hands its worker (scratch, never part of a payload)."""
META_KEYS = ("exported_dims", "traced_at")
logger = logging.getLogger("aitune")


class TorchInductorAotBackend(Backend):
    """torch.export + AOTInductor: the module compiled ahead of time into a shared library.

    ``build`` exports the module with one ``torch.export.Dim`` per named dynamic dimension of the
    graph, compiles and packages it; ``save`` copies the package; ``load`` opens it with the C++
    package loader, which compiles nothing. An isolated build splits ``build`` in two: ``export``
    saves the exported program, ``build_exported`` compiles it in a worker into the payload
    ``save`` would write, and the user's process ``load`` s that.
    """

    name = "torch_inductor_aot"
    config_class = TorchInductorAotBackendConfig
    config: TorchInductorAotBackendConfig
    native_build = True
    build_cost = 6.0  # export, then Inductor's kernels compiled ahead into a shared library
    warm_imports = (*INDUCTOR_MODULES, "torch._inductor.package", "torch._export.serde.serialize")
    retry_in_process = True
    """A safety net: the worker compiles a program that went through torch.export.save/load. What
    that round trip was seen to lose (the traced ranges, custom operators) is restored in the worker
    (:mod:`.roundtrip`); a failure with another cause still gets the live program compiled here."""
    native_payload = True  # the package holds a shared library that load() runs
    builds_static = True  # a graph whose dims are single sizes is exported without a torch.export.Dim

    def __init__(self, config: TorchInductorAotBackendConfig | None = None) -> None:
        super().__init__(config)
        self._loader: Any = None
        self._graph: GraphSpec | None = None
        self._package: Path | None = None
        self._meta: dict[str, Any] = {}

    def unsupported_reason(self, graph: GraphSpec, device: torch.device) -> str | None:
        if device.type not in ("cpu", "cuda"):
            return f"AOTInductor packages here run on cpu or cuda, not {device.type}"
        return None

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        start = time.perf_counter()
        program, self._meta = _export(module, context, self.config.strict)
        export_s = time.perf_counter() - start
        path = self._workspace() / PACKAGE
        folder = _compile(program, self.config, context.cache_dir, path)
        try:
            self._open(path, context.graph, context.device)
        except SerializationError as exc:
            raise BuildError(f"the package AOTInductor wrote cannot be loaded: {exc}") from exc
        self.build_info.update(self._meta, cache_dir=str(folder))
        self.build_info[EXPORT_S] = round(export_s, 3)  # the report counts it as export, the rest as build

    # -- isolated builds: export here, compile in a worker, load the package it wrote ---------------

    def export(self, module: torch.nn.Module, context: BuildContext, directory: Path) -> dict[str, Any] | None:
        """``torch.export`` in this process, saved with ``torch.export.save`` for the worker to compile,
        with what the file loses (see :mod:`.roundtrip`): the ranges the dynamic sizes were traced
        under and the modules that register the custom operators it calls. None (built in this
        process) when an operator's registration cannot be named: the worker could not load it."""
        program, meta = _export(module, context, self.config.strict)
        imports, unknown = operator_modules(program)
        if unknown:
            logger.info(
                "%s: %s builds in this process: the exported program calls %s, registered by a module "
                "aitune cannot name, so a build worker could not load it",
                context.module_name,
                self.name,
                ", ".join(unknown),
            )
            return None
        torch.export.save(program, Path(directory) / EXPORTED)
        return {"program": EXPORTED, "compiler_ranges": compiler_ranges(program), "imports": imports, **meta}

    @classmethod
    def build_exported(
        cls,
        config: BackendConfig,
        exported: Path,
        notes: dict[str, Any],
        context: BuildContext,
        payload: Path,
    ) -> dict[str, Any]:
        """In the worker: load the exported program, compile and package it as ``save`` would write it.

        ``torch.export.load`` may unpickle parts of the program; the file is the one ``export``
        wrote moments ago into aitune's own scratch folder, never one read from an artifact.
        """
        if not isinstance(config, TorchInductorAotBackendConfig):
            raise TypeError(f"{cls.__name__} builds from a TorchInductorAotBackendConfig, got {type(config).__name__}")
        import_modules(notes.get("imports", []))  # before load: it resolves every operator by name
        try:
            program = torch.export.load(exported_file(exported, notes, "program", EXPORTED))
            restore_ranges(program, notes.get("compiler_ranges", {}))
        except Exception as exc:
            raise BuildError(
                f"the worker cannot read the exported program: {type(exc).__name__}: {_first_lines(exc)}. "
                "Build in-process instead (AITUNE_ISOLATE=none)"
            ) from exc
        path = Path(payload) / PACKAGE
        _compile(program, config, context.cache_dir, path)
        try:
            check_archive(path)
        except SerializationError as exc:
            raise BuildError(f"the package AOTInductor wrote cannot be loaded: {exc}") from exc
        _agrees_with_program(program, path, context.graph)
        return _metadata({k: notes[k] for k in META_KEYS if k in notes})

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        if self._loader is None or self._graph is None:
            raise BuildError("TorchInductorAotBackend used before build() or load()")
        graph = self._graph
        if kwargs:
            kwargs = {k: kwargs[k] for k in _kwarg_names(graph)}  # the order the package was exported in
        flat = [t.contiguous() for t in graph.flatten(args, kwargs)]
        outputs = self._loader.boxed_run(flat)
        if graph.output_structure is not None:
            return graph.unflatten_outputs(outputs)
        from torch.utils import _pytree as pytree

        return pytree.tree_unflatten(outputs, pytree.treespec_loads(self._loader.get_call_spec()[1]))

    def save(self, directory: Path) -> dict[str, Any]:
        if self._package is None:
            raise SerializationError("TorchInductorAotBackend.save() called before build() or load()")
        shutil.copyfile(self._package, Path(directory) / PACKAGE)
        return _metadata(self._meta)

    def refit(self, weights: Mapping[str, torch.Tensor]) -> bool:
        """Replace the package's constants with the new weights (``load_constants``), no compile.

        Builds keep every weight a named constant (``always_keep_tensor_constants``); a constant
        whose weight is missing or of another shape makes it False, and a weight the compiler folded
        into code anyway is caught by the check against eager that follows.
        """
        if self._loader is None or self._graph is None:
            return False
        updates: dict[str, torch.Tensor] = {}
        for fqn in self._loader.get_constant_fqns():
            tensor = weights.get(fqn.removeprefix("module."))  # FlatModule holds the module as .module
            if tensor is None:
                continue  # a constant of the program, not a weight
            updates[fqn] = tensor.detach().contiguous()
        if not updates:
            return False
        self._loader.load_constants(updates, False, False, False)
        self.build_info.update(refitted=True, refitted_constants=len(updates))
        return True

    def load(self, module: torch.nn.Module, directory: Path, context: LoadContext) -> None:
        metadata = context.metadata
        name = metadata.get("package", PACKAGE)
        if not isinstance(name, str) or PurePath(name).name != name or not name.endswith(".pt2"):
            raise SerializationError(f"the payload names the package {name!r}, which is not a plain .pt2 file name")
        source = Path(directory) / name
        if not source.is_file():
            raise SerializationError(f"the payload has no {name}; the artifact is incomplete, rebuild it")
        built = str(metadata.get("torch", ""))
        if built and _minor(built) != _minor(torch.__version__):
            raise SerializationError(
                f"{name} was compiled against torch {built}, this is torch {torch.__version__}: its shared library "
                "links against torch's runtime, so rebuild the artifact with this torch"
            )
        path = self._workspace() / PACKAGE
        shutil.copyfile(source, path)
        self._meta = {k: metadata[k] for k in META_KEYS if k in metadata}
        self._open(path, context.graph, context.device)
        self.build_info.update(self._meta, compiled_on_load=False)

    # -- helpers --------------------------------------------------------------------------------

    def _open(self, path: Path, graph: GraphSpec, device: torch.device) -> None:
        loader, aoti_metadata, library = open_package(path, device)
        self._loader, self._graph, self._package = loader, graph, path
        self.build_info.update(
            package=PACKAGE,
            package_bytes=path.stat().st_size,
            shared_library=library,
            loader="torch._C._aoti.AOTIModelPackageLoader",
            aoti_metadata=aoti_metadata,
            device=str(device),
        )

    def _workspace(self) -> Path:
        """A folder owned by this backend (the build's workdir is removed before ``save`` may run)."""
        return owned_folder("aitune-aoti-", self)


def _export(module: torch.nn.Module, context: BuildContext, strict: bool) -> tuple[Any, dict[str, Any]]:
    """``torch.export`` with one ``Dim`` per named dynamic dimension; the program and the facts for ``build_info``."""
    graph = context.graph
    if not context.samples:
        raise BuildError("AOTInductor needs one recorded sample to trace the module; none was given")
    sizes = trace_sizes(graph)
    sample = _contiguous(graph, resize(graph, context.samples[0], sizes))
    dynamic_shapes, ranges = export_dynamic_shapes(graph)
    flat = tuple(graph.flatten(sample.args, sample.kwargs))
    try:  # flat tensors in, flat tensors out: any signature exports, and infer runs it as it is
        with exclusive(FlatModule(module, graph)) as traced:  # a copy: the program's calls never meet the trace
            program = torch.export.export(traced, flat, dynamic_shapes=dynamic_shapes, strict=strict)
    except Exception as exc:
        raise BuildError(
            f"torch.export failed with dynamic dims {ranges or 'none'}: {type(exc).__name__}: {_first_lines(exc)}. "
            "If a dimension was specialized, the module's code fixes its size: narrow the graph's range "
            "or declare the axis static"
        ) from exc
    return program, {"exported_dims": ranges, "traced_at": {n: v for n, v in sizes.items() if n in ranges}}


def _compile(program: Any, config: TorchInductorAotBackendConfig, cache_dir: Path, path: Path) -> Path:
    """AOTInductor: compile ``program`` and package it at ``path``; returns Inductor's cache folder."""
    with inductor_cache(cache_dir) as folder:
        try:
            from torch._inductor import aoti_compile_and_package

            # every weight stays a named constant of the package, so refit can replace it; no
            # precompiled headers (Inductor keeps them in its default folder, see inductor_options)
            options = inductor_options({"always_keep_tensor_constants": True, **(capped_options(config.options) or {})})
            aoti_compile_and_package(program, package_path=str(path), inductor_configs=options)
        except Exception as exc:
            raise BuildError(
                f"AOTInductor failed to compile the exported module: {type(exc).__name__}: {_first_lines(exc)}"
            ) from exc
    return folder


def _metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """What ``save`` returns and ``load`` reads: the package's name, torch's version, the export facts."""
    return {"format": 1, "package": PACKAGE, "torch": torch.__version__, **meta}


def _contiguous(graph: GraphSpec, sample: Sample) -> Sample:
    """Export from contiguous inputs, as ``infer`` passes them: the package bakes in input strides."""
    args, kwargs = graph.unflatten([t.contiguous() for t in graph.flatten(sample.args, sample.kwargs)])
    return Sample(args, kwargs)


def _kwarg_names(graph: GraphSpec) -> list[str]:
    return list(graph.structure["items"][1].get("keys", []))


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _agrees_with_program(program: Any, package: Path, graph: GraphSpec) -> None:
    """In the worker: run the package and the exported program side by side at every range's ends.

    A package compiled from a program that went through ``torch.export.save``/``load`` without
    its traced ranges restored ignored a dynamic axis (torch 2.13: called at batch 1 it returned
    batch 2 or read out of bounds; see :mod:`.roundtrip`). Should a round trip lose something else,
    the build costs its candidate here, in the worker, never the user's process when the package
    is loaded and warmed up.
    """
    from torch._inductor import aoti_load_package
    from torch.utils import _pytree as pytree

    compiled, reference = aoti_load_package(str(package)), program.module()
    for which in ("min", "max") if graph.dims else ("opt",):
        sample = graph.example(which)
        flat = [t.contiguous() for t in graph.flatten(sample.args, sample.kwargs)]
        with torch.no_grad():
            try:
                got = pytree.tree_leaves(compiled(*flat))
            except Exception as exc:
                raise BuildError(
                    f"the AOTInductor package fails at the {which} shapes ({type(exc).__name__}: {_first_lines(exc)}); "
                    "build in-process instead (AITUNE_ISOLATE=none)"
                ) from exc
            want = pytree.tree_leaves(reference(*flat))
        for i, (g, w) in enumerate(zip(got, want)):
            if not isinstance(w, torch.Tensor):
                continue
            if not isinstance(g, torch.Tensor) or g.shape != w.shape:
                raise BuildError(
                    f"the AOTInductor package returns output {i} with shape {getattr(g, 'shape', None)} at the "
                    f"{which} shapes, where the exported program returns {tuple(w.shape)}: the compiled package "
                    "lost a dynamic axis; build in-process instead (AITUNE_ISOLATE=none)"
                )
            if w.is_floating_point() and w.numel():
                err = float((g.double() - w.double()).abs().max())
                bound = 1e-4 + 1e-2 * float(w.abs().max())  # a gross disagreement, not kernel rounding
                if err > bound:
                    raise BuildError(
                        f"the AOTInductor package disagrees with the exported program at the {which} shapes "
                        f"(output {i}: max abs difference {err:.3g}); build in-process instead (AITUNE_ISOLATE=none)"
                    )


def _first_lines(exc: Exception, n: int = 3) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return " ".join(lines[:n])
