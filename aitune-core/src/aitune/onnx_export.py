"""ONNX export of one graph of a module, shared by the ONNX Runtime and TensorRT backends.

The module is wrapped so that the exporter sees a flat list of tensors in ``graph.inputs``
order and returns a flat list in output order: nested tuples, lists and dicts become named ONNX
inputs and outputs (names from ``TensorSpec.path``, sanitized), and ``graph.unflatten_outputs``
puts the structure back. Dynamic axes come from the graph's named dims (``batch``, ``d0``...).

The ``torch.export``-based exporter (``dynamo``) runs first: it handles modern models (fused
transformer layers, for one) that the TorchScript exporter cannot, and TorchScript export is
deprecated. It is slower (seconds, not tenths), so the TorchScript exporter stays available as
an explicit choice and, by default, as the fallback when the dynamo exporter fails.

``onnx`` and ``onnxscript`` are imported only inside functions: aitune-core does not depend on
them, the backends that export do.

Both ONNX backends call :func:`export_onnx`, which picks the exporter, falls back, writes large
weights as external data and raises one set of errors for all of it.

Neither exporter keeps a branch its sample did not take. The TorchScript trace is judged where the
tracer warned (:mod:`aitune.traced_branches`); the dynamo export is captured here (the ONNX
exporter's own capture would narrow a dim's range, or drop a size assertion, without a word), and
every size condition the capture holds is judged at sizes of the tuned range on its other side:
kept where it answers as eager there, else refused, so such a size never gets the other side's
answer in silence.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from . import traced_branches, tracing, tree
from .errors import BuildError, ConfigError, NotApplicableError
from .graph import FlatModule, GraphSpec, Sample, TensorSpec, resize
from .text import clip
from .tracer_output import captured

EXPORTERS = ("dynamo", "torchscript")
EXTERNAL_DATA_THRESHOLD = 1 << 30
"""Weights of at least this many bytes go to an external data file (protobuf stops at 2 GiB)."""
MODEL_FILE = "model.onnx"


EXPORTER_MODULES = (
    "onnx",
    "onnx.checker",
    "onnx.helper",
    "onnx.shape_inference",
    "onnx.external_data_helper",
    "onnxscript",
    "onnxscript.function_libs.torch_lib.ops",
    "onnxscript.optimizer",
    "onnxscript.rewriter.rules.common",
    "onnxscript.rewriter.onnx_fusions",
    "onnxscript.version_converter",
    "onnx_ir.passes.common",
    "torch.onnx",
    "torch.onnx._internal.exporter._core",
    "torch.onnx._internal.exporter._compat",
    "onnxscript._framework_apis.torch_2_9",
    "torch.onnx._internal.exporter._torchlib.ops",
    "torch.onnx._internal.exporter._fx_passes",
    "torch.onnx._internal.exporter._decomp",
    "torch.onnx._internal.exporter._dispatching",
    "torch.onnx._internal.exporter._verification",
)
"""What an ONNX export imports on first use (torch 2.13's exporter, onnxscript, onnx): the
``warm_imports`` of the backends that export ONNX, so background JIT tuning imports them before
the program serves (:mod:`aitune.engine.jit.preload`)."""


def _one_of(choices: Sequence[str]) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            raise ConfigError(f"{type(instance).__name__}.{attribute.name} is {value!r}; choose one of {list(choices)}")

    return check


def _optional_bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{type(instance).__name__}.{attribute.name} must be True, False or None, got {value!r}")


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{type(instance).__name__}.{attribute.name} must be True or False, got {value!r}")


def _opset(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 7:
        raise ConfigError(
            f"{type(instance).__name__}.opset is {value!r}; give an ONNX opset version >= 7 (e.g. 17 or 20), "
            "or None for the exporter's default"
        )


@attrs.frozen(kw_only=True)
class ONNXExportConfig:
    """How to export a module to ONNX."""

    exporter: str = attrs.field(default="dynamo", validator=_one_of(EXPORTERS))
    """``"dynamo"`` (torch.export based, tried first) or ``"torchscript"`` (the legacy tracer)."""
    fallback_to_torchscript: bool = attrs.field(default=True, validator=_bool)
    """When the dynamo exporter fails, try the TorchScript exporter before giving up."""
    opset: int | None = attrs.field(default=None, validator=_opset)
    """ONNX opset version; None takes the exporter's default."""
    external_data: bool | None = attrs.field(default=None, validator=_optional_bool)
    """Weights in a separate ``.onnx.data`` file; None decides by weight size (>= 1 GiB)."""
    check: bool = attrs.field(default=True, validator=_bool)
    """Run ``onnx.checker`` on the result (path based, so large models work)."""
    trace_control_flow: bool = attrs.field(default=False, validator=_bool)
    """Accept a TorchScript trace whose tracer warned of data-dependent control flow (a tensor turned
    into a Python bool or number) without judging it. Such a trace keeps only the branches the export
    sample took, so by default it is judged (:mod:`aitune.traced_branches`): kept only when it answers
    as eager on inputs made to take the other side of each branch, else refused with the reason."""


@attrs.frozen(kw_only=True)
class ONNXExport:
    """What :func:`export_onnx` produced."""

    path: Path
    """The ``.onnx`` file."""
    files: tuple[str, ...]
    """Every file the model needs, relative to ``path.parent``: the ``.onnx`` and its external data."""
    input_names: tuple[str, ...]
    """ONNX input names, one per ``graph.inputs`` entry, in that order (every one is a graph input)."""
    output_names: tuple[str, ...]
    """ONNX output names, in flattened output order (``graph.outputs`` order when recorded)."""
    exporter: str
    """The exporter that actually produced the model."""
    opset: int
    output_structure: dict[str, Any] = attrs.field(factory=dict)
    """How to rebuild the module's output from the flat outputs (:mod:`aitune.tree`)."""
    fallback_reason: str | None = None
    """Why the dynamo exporter was not used, when the TorchScript fallback produced the model."""
    seconds: float = 0.0
    traced_branches: tuple[dict[str, Any], ...] = ()
    """Where the TorchScript trace froze a Python value, or the dynamo export held a size condition,
    and how each was judged (see :func:`aitune.traced_branches.judge` and
    :func:`~aitune.traced_branches.judge_guards`); empty where there was none."""


def export_onnx(
    module: torch.nn.Module,
    graph: GraphSpec,
    sample: Sample,
    directory: Path,
    config: ONNXExportConfig = ONNXExportConfig(),
    samples: Sequence[Sample] = (),
) -> ONNXExport:
    """Export ``module`` for ``graph`` into ``directory`` (as ``model.onnx`` plus external data).

    ``sample`` is one real call of the graph; it is resized so every dynamic axis takes a
    distinct value >= 2, which keeps the exporter from specialising an axis to a constant.
    ``samples`` (the other recorded calls) let the TorchScript exporter trace from one on the
    general side of a branch (a padded mask) and judge the branches it froze on them.
    Raises :class:`BuildError` naming the unsupported operator or construct.
    """
    try:
        import onnx  # noqa: F401
    except ImportError as exc:
        raise BuildError(
            f"ONNX export needs the onnx package ({exc}); install it with: pip install onnx onnxscript"
        ) from exc
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    recorded = [sample, *(s for s in samples if s is not sample)]
    sizes = _export_sizes(graph)
    sample = resize(graph, sample, sizes)
    flat_inputs = tuple(graph.flatten(sample.args, sample.kwargs))
    wrapper = FlatModule(module, graph).train(module.training)  # a new module starts in training mode
    with torch.no_grad():
        out_leaves, out_structure = tree.flatten(module(*sample.args, **sample.kwargs))
    if not out_leaves:
        raise BuildError(
            "the module returns no tensor, so there is nothing to export to ONNX; tune a module that returns tensors"
        )
    if graph.output_structure is not None:
        out_structure = graph.output_structure
    input_names = _names([s.path for s in graph.inputs], "input")
    out_paths = [s.path for s in graph.outputs] or tree.leaf_paths(out_structure)
    output_names = _names([p or "output" for p in out_paths], "output", taken=set(input_names))
    if len(output_names) != len(out_leaves):
        raise BuildError(
            f"the module returned {len(out_leaves)} tensors but its recorded output structure has "
            f"{len(output_names)}; its outputs must keep one structure for one input structure"
        )
    external = config.external_data
    if external is None:
        external = _weight_bytes(module) >= EXTERNAL_DATA_THRESHOLD
    path = directory / MODEL_FILE
    for stale in (path, directory / f"{MODEL_FILE}.data"):
        stale.unlink(missing_ok=True)

    order = ["dynamo", "torchscript"] if config.exporter == "dynamo" else ["torchscript"]
    if config.exporter == "dynamo" and not config.fallback_to_torchscript:
        order = ["dynamo"]
    failures: list[tuple[str, str]] = []
    inapplicable = 0
    """Failures by design (a TorchScript trace of data-dependent control flow): when every exporter
    tried refused so, the candidate does not apply to this module rather than failing."""
    judged: list[dict[str, Any]] = []
    for exporter in order:
        try:
            with _quiet(f"the {exporter} ONNX export of {type(module).__name__}"), _modes_kept(module):
                if exporter == "dynamo":
                    judged = _dynamo(
                        wrapper, flat_inputs, graph, sizes, input_names, output_names, path, config.opset, external
                    )
                else:
                    general = traced_branches.general_sample(graph, recorded, sizes)
                    judged = _torchscript(
                        wrapper, general, recorded, graph, input_names, output_names, path, config, external
                    )
            _check_dynamic_axes(path, graph, input_names)
        except BuildError as exc:
            failures.append((exporter, str(exc)))
            inapplicable += isinstance(exc, NotApplicableError)
            continue
        except Exception as exc:
            failures.append((exporter, _explain(exc)))
            continue
        break
    else:
        error = NotApplicableError if inapplicable == len(failures) else BuildError
        raise error(_failure_message(module, failures))

    if config.check:
        _check(path)
    return ONNXExport(
        path=path,
        files=model_files(path),
        input_names=tuple(input_names),
        output_names=tuple(output_names),
        exporter=exporter,
        opset=_opset_of(path),
        output_structure=out_structure,
        fallback_reason=failures[0][1] if failures else None,
        seconds=time.perf_counter() - start,
        traced_branches=tuple(judged),
    )


def model_files(path: Path) -> tuple[str, ...]:
    """The ``.onnx`` file and every external data file it references, relative to its folder.

    A model saved by ONNX Runtime after optimisation still references the original model's
    external data file, so a payload must carry what this lists, not just the ``.onnx``.
    """
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    found: list[str] = [Path(path).name]
    for tensor in _tensors(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in tensor.external_data if e.key == "location"), None)
            if location and location not in found:
                found.append(location)
    return tuple(found)


def onnx_name(path: str, kind: str = "input") -> str:
    """A valid, readable ONNX value name for a tensor path: ``inputs.mask`` -> ``inputs_mask``."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", path).strip("_")
    if not name or name[0].isdigit():
        name = f"{kind}_{name}" if name else kind
    return name


def _names(paths: Sequence[str], kind: str, taken: set[str] | None = None) -> list[str]:
    seen = set(taken or ())
    out = []
    for path in paths:
        base = name = onnx_name(path, kind)
        i = 1
        while name in seen:
            name = f"{base}_{i}"
            i += 1
        seen.add(name)
        out.append(name)
    return out


def _dynamic(graph: GraphSpec, spec: TensorSpec) -> dict[int, str]:
    """Axes of ``spec`` that really vary (a dim whose min equals its max is exported static)."""
    return {
        axis: name
        for axis, name in enumerate(spec.dims)
        if name is not None and graph.dims[name].min != graph.dims[name].max
    }


def _export_sizes(graph: GraphSpec) -> dict[str, int]:
    """One size per dynamic dim: >= 2 (0 and 1 get specialised) and distinct (equal sizes get merged)."""
    static = {size for spec in graph.inputs for size, name in zip(spec.shape, spec.dims) if name is None}
    chosen: dict[str, int] = {}
    for name, rng in graph.dims.items():
        if rng.min == rng.max:
            continue
        lo = max(rng.min, 2)
        candidates = [rng.opt, *range(lo, min(rng.max, lo + 256) + 1)]
        usable = [v for v in candidates if rng.min <= v <= rng.max and v >= 2 and v not in chosen.values()]
        preferred = [v for v in usable if v not in static]
        if preferred or usable:
            chosen[name] = (preferred or usable)[0]
    return chosen


def _weight_bytes(module: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@contextlib.contextmanager
def _quiet(what: str) -> Iterator[None]:
    """Exporters print progress, IR dumps and warnings; the error, if any, carries what matters.
    What this thread prints goes to aitune's log at DEBUG (:func:`aitune.tracer_output.captured`;
    other threads' output stays theirs)."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), captured(what):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def _modes_kept(module: torch.nn.Module) -> Iterator[None]:
    """Every submodule's train/eval mode as it was, whatever an exporter switched (the TorchScript
    exporter restores the mode of the module it was handed, which is not the user's)."""
    modes = [(m, m.training) for m in module.modules()]
    try:
        yield
    finally:
        for submodule, training in modes:
            submodule.training = training


def _dynamic_shapes(graph: GraphSpec) -> Any:
    """``torch.export``'s ``dynamic_shapes`` for :class:`FlatModule` of ``graph``: one named ``Dim``
    per dynamic dim, with its tuned range; None when nothing varies."""
    from torch.export import Dim

    dims = {name: Dim(name, min=rng.min, max=rng.max) for name, rng in graph.dims.items() if rng.min != rng.max}
    if not dims:
        return None
    per_input = tuple(
        {axis: dims[name] for axis, name in _dynamic(graph, spec).items()} or None for spec in graph.inputs
    )
    return (per_input,)


def _capture(wrapper: torch.nn.Module, inputs: tuple[torch.Tensor, ...], dynamic_shapes: Any) -> Any:
    """``torch.export`` of ``wrapper`` as the ONNX exporter's first strategy takes it (non-strict,
    guards on sizes as runtime assertions), and like it, where the code narrows a dim's range (a
    size compared with a constant), exported again on the narrowed range: the narrowing stays in
    ``range_constraints`` for :func:`aitune.traced_branches.judge_guards` to judge, where the ONNX
    exporter would have dropped it without a word. Raises what ``torch.export`` raises otherwise."""
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

    with contextlib.ExitStack() as stack:
        config = getattr(getattr(torch.fx, "experimental", None), "_config", None)
        if config is not None and hasattr(config, "backed_size_oblivious"):
            stack.enter_context(config.patch(backed_size_oblivious=True))  # 0/1 sizes stay dynamic
        if dynamic_shapes is not None:
            with contextlib.suppress(ImportError):
                from torch.export import _patches

                stack.enter_context(_patches.register_lstm_while_loop_decomposition())
                stack.enter_context(_patches.register_gru_while_loop_decomposition())

        def export(shapes: Any) -> Any:
            return torch.export.export(
                wrapper, inputs, dynamic_shapes=shapes, strict=False, prefer_deferred_runtime_asserts_over_guards=True
            )

        try:
            return export(dynamic_shapes)
        except torch._dynamo.exc.UserError as exc:
            if dynamic_shapes is None or "Constraints violated" not in str(exc):
                raise
            return export(refine_dynamic_shapes_from_suggested_fixes(exc.msg, dynamic_shapes))


def _dynamo(
    wrapper: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    graph: GraphSpec,
    sizes: dict[str, int],
    input_names: list[str],
    output_names: list[str],
    path: Path,
    opset: int | None,
    external: bool,
) -> list[dict[str, Any]]:
    """The dynamo export, from a program captured here so the size conditions it holds are judged
    (the ONNX graph has no runtime assertions); the guards judged. Where the capture fails, the
    ONNX exporter's own strategies run, and the program they made is judged."""
    import torch.onnx

    dynamic_shapes = _dynamic_shapes(graph)
    with torch.no_grad(), tracing.exclusive(wrapper) as traced:  # a copy: the program's calls never meet the trace
        try:
            captured = _capture(traced, inputs, dynamic_shapes)
        except Exception:
            captured = None
        program = torch.onnx.export(
            captured if captured is not None else traced,
            inputs,
            dynamo=True,
            input_names=input_names,
            output_names=output_names,
            opset_version=opset,
            dynamic_shapes=dynamic_shapes,  # with a captured program: only to name the ONNX axes after the dims
            verbose=False,
        )
        assert program is not None
        exported = captured if captured is not None else program.exported_program
        sample = Sample(*graph.unflatten(list(inputs)))
        why, judged = traced_branches.judge_guards(exported, wrapper, graph, sample, sizes)
    if why is not None:
        raise NotApplicableError(
            "the exported graph keeps only the side of a size comparison in the code that its sample took, and it "
            f"was not kept: {why}; it is refused (make the code size-generic there, or tune a range that stays on "
            "one side of it, e.g. with ait.DynamicDim)"
        )
    program.save(str(path), external_data=external)
    return judged


def _torchscript(
    wrapper: torch.nn.Module,
    sample: Sample,
    recorded: Sequence[Sample],
    graph: GraphSpec,
    input_names: list[str],
    output_names: list[str],
    path: Path,
    config: ONNXExportConfig,
    external: bool,
) -> list[dict[str, Any]]:
    """The TorchScript export, traced from ``sample``; the branches it froze, as judged."""
    import onnx
    import torch.onnx

    inputs = tuple(graph.flatten(sample.args, sample.kwargs))
    dynamic_axes = {name: axes for name, spec in zip(input_names, graph.inputs) if (axes := _dynamic(graph, spec))}
    scratch = path.parent / ".torchscript-export"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    judged: list[dict[str, Any]] = []
    try:
        with torch.no_grad(), tracing.exclusive(wrapper) as traced, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.onnx.export(
                traced,
                inputs,
                str(scratch / path.name),
                dynamo=False,
                input_names=input_names,
                output_names=output_names,
                opset_version=config.opset,
                dynamic_axes=dynamic_axes or None,
            )
        found = traced_branches.branches(caught)
        if found and not config.trace_control_flow:
            with torch.no_grad(), tracing.exclusive(wrapper) as copy, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                script = torch.jit.trace(copy, inputs, check_trace=False)
                why, judged = traced_branches.judge(
                    script, wrapper, graph, found, sample, recorded, lambda: _sizes_past(copy, inputs, graph, sample)
                )
            if why is not None:
                raise NotApplicableError(
                    "the TorchScript tracer reports data-dependent control flow (a tensor turned into a Python "
                    f"value at {_judged_site(found)}: {clip(found[0].message, 200)}), so its graph keeps only the branch "
                    f"its sample took, and it was not kept: {why}; it is refused "
                    "(ONNXExportConfig(trace_control_flow=True) accepts it when that branch is the only one your "
                    "inputs take)"
                )
        model = onnx.load(str(scratch / path.name))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _restore_unused_inputs(model, graph, input_names)
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location=f"{path.name}.data",
    )
    return judged


def _sizes_past(
    wrapper: torch.nn.Module, inputs: tuple[torch.Tensor, ...], graph: GraphSpec, sample: Sample
) -> list[tuple[str, Sample]]:
    """Inputs at the sizes where the code's size comparisons turn, read from a ``torch.export``
    capture (none where it cannot capture the module: min, max and the recorded sizes remain)."""
    sizes = _traced_sizes(graph, inputs)
    if not any(rng.min != rng.max for rng in graph.dims.values()):
        return []
    try:
        program = _capture(wrapper, inputs, _dynamic_shapes(graph))
    except Exception:
        return []
    return traced_branches.sizes_past(traced_branches.shape_guards(program, graph, sizes), graph, sample, sizes)


def _traced_sizes(graph: GraphSpec, inputs: Sequence[torch.Tensor]) -> dict[str, int]:
    """Each dynamic dim's size in ``inputs``."""
    out: dict[str, int] = {}
    for t, spec in zip(inputs, graph.inputs):
        for axis, name in enumerate(spec.dims):
            if name is not None and name in graph.dims and axis < t.dim():
                out.setdefault(name, int(t.shape[axis]))
    return out


def _judged_site(found: Sequence[traced_branches.Branch]) -> str:
    """The first branch's place, and how many more there are."""
    first = f"{found[0].site[0].rsplit('/', 1)[-1]}:{found[0].site[1]}"
    return first + (f" and {len(found) - 1} more place(s)" if len(found) > 1 else "")


def _restore_unused_inputs(model: Any, graph: GraphSpec, input_names: list[str]) -> None:
    """The TorchScript exporter drops inputs the model ignores; put them back, in graph order.

    Consumers bind inputs by ``graph.inputs``, so every one must exist in the ONNX graph.
    """
    from onnx import helper

    present = {v.name: v for v in model.graph.input}
    ordered = []
    for name, spec in zip(input_names, graph.inputs):
        if name in present:
            ordered.append(present[name])
            continue
        shape = [spec.dims[a] if a in _dynamic(graph, spec) else size for a, size in enumerate(spec.shape)]
        ordered.append(helper.make_tensor_value_info(name, _ONNX_TYPES[spec.dtype], shape))
    extra = [v for n, v in present.items() if n not in input_names]
    del model.graph.input[:]
    model.graph.input.extend(ordered + extra)


_ONNX_TYPES = {
    "float32": 1, "uint8": 2, "int8": 3, "uint16": 4, "int16": 5, "int32": 6, "int64": 7,
    "bool": 9, "float16": 10, "float64": 11, "uint32": 12, "uint64": 13, "bfloat16": 16,
}  # fmt: skip
"""torch dtype name -> onnx.TensorProto data type."""


def _check_dynamic_axes(path: Path, graph: GraphSpec, input_names: list[str]) -> None:
    """The dynamo exporter may silently fix an axis the model's code makes static; refuse that."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    shapes = {v.name: v.type.tensor_type.shape.dim for v in model.graph.input}
    for name, spec in zip(input_names, graph.inputs):
        if name not in shapes:
            raise BuildError(f"the exported model lost the input {name!r} ({spec.path})")
        for axis, dim in _dynamic(graph, spec).items():
            d = shapes[name][axis]
            if not d.dim_param and d.HasField("dim_value"):
                rng = graph.dims[dim]
                raise BuildError(
                    f"the exporter fixed axis {axis} of input {spec.path!r} (dim {dim!r}, tuned for "
                    f"{rng.min}..{rng.max}) to {d.dim_value}: the model's code ties that axis to a constant "
                    "(a Python loop over it, a reshape or view to a fixed size, a constant tensor it meets); make "
                    "the code size-generic or tune with that axis static"
                )


def _check(path: Path) -> None:
    import onnx

    try:
        onnx.checker.check_model(str(path))
    except Exception as exc:  # onnx.checker.ValidationError and protobuf errors
        raise BuildError(
            f"the exported ONNX model does not pass onnx.checker: {clip(str(exc), 500)}; export with another "
            "exporter or opset (ONNXExportConfig(exporter=..., opset=...)), or turn the check off with check=False"
        ) from exc


def _opset_of(path: Path) -> int:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _tensors(graph: Any) -> Iterator[Any]:
    """Every TensorProto of a graph: initializers and node attributes, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for g in attr.graphs:
                yield from _tensors(g)


# -- errors -----------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _explain(exc: Exception) -> str:
    """The operator or construct an exporter could not handle, from its exception text."""
    text = _ANSI.sub("", str(exc))
    if m := re.search(r"No ONNX function found for <OpOverload\(op='([^']+)'", text):
        return f"the operator {m.group(1)} has no ONNX translation"
    if m := re.search(r"Exporting the operator '([^']+)' to ONNX opset version (\d+) is not supported", text):
        return f"the operator {m.group(1)} is not supported at ONNX opset {m.group(2)}"
    if "data-dependent" in text or "GuardOnDataDependentSymNode" in text:
        return (
            "the model has data-dependent control flow or shapes (a Python `if` or a size computed from "
            "tensor values, e.g. `.item()`), which torch.export cannot trace"
        )
    if m := re.search(r"Constraints violated \(([^)]*)\)", text):
        return f"the model's code fixes the dynamic dims {m.group(1)} to constant sizes"
    summary = text.split("## Exception summary", 1)[-1].strip()
    first = next((line.strip() for line in summary.splitlines() if line.strip()), type(exc).__name__)
    return f"{type(exc).__name__}: {clip(first, 400)}"


def _failure_message(module: torch.nn.Module, failures: list[tuple[str, str]]) -> str:
    tried = "; ".join(f"the {name} exporter failed: {reason}" for name, reason in failures)
    hint = "rewrite or avoid that part of the model, try the other exporter (ONNXExportConfig(exporter=...))"
    if len(failures) > 1:
        hint = "rewrite or avoid that part of the model"
    return f"ONNX export of {type(module).__name__} failed: {tried}. To fix it, {hint}, or choose a backend that does not export to ONNX."
