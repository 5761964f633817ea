"""TorchInductorJitBackend: ``torch.compile`` with Inductor, compiled and warmed up inside ``build``."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from aitune.plugin import (
    INDUCTOR_MODULES,
    Backend,
    BuildContext,
    BuildError,
    GraphSpec,
    InductorCacheSwitch,
    LoadContext,
    Sample,
    inductor_cache,
    inductor_options,
    resize,
    tree,
)

from .config import TorchInductorJitBackendConfig, capped_options
from .recompiles import RecompileWatch, predicted_recompiles
from .shapes import dim_sizes, unseen_sizes, warmup_cases

RECOMPILE_LIMIT = 64
"""Dynamo's per-function recompile limit while aitune builds (a graph's warm-up sizes and probes)."""

ISOLATED: dict[str, Any] = (
    {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}
)
"""``torch.compile``'s ``isolate_recompiles=True`` where this torch has it (2.13): each build's compiled
code and recompile count its own. TorchDynamo keeps both per code object of the frame it starts from,
and transformers 5 shares one forward code across models (its ``merge_with_config_defaults``
wrapper): in a process that tunes or loads several models their compiles piled onto one code
object, and once one of them hit the limit (8) Dynamo ran that code uncompiled for every model,
without a word (Mistral's decode step half eager, Qwen2's candidate timed uncompiled and rejected).
Older torch shares, as before."""


def _building(**more: Any) -> Any:
    """Dynamo's config while aitune builds: the recompile limit raised to :data:`RECOMPILE_LIMIT`
    (where it is lower), and ``more`` of Dynamo's settings."""
    return torch._dynamo.config.patch(
        recompile_limit=max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT), **more
    )


class TorchInductorJitBackend(Backend):
    """torch.compile with the Inductor backend, compiled in the process.

    Nothing compiled survives ``save``: ``load`` compiles again (from Inductor's on-disk cache
    when it is warm) and warms up, before the first call. A call at a shape the warm-up did not
    cover compiles again, so every call runs with Inductor pointed at the folder the build or load
    checked (:class:`InductorCacheSwitch`), never at Inductor's default folder in ``/tmp``.
    """

    name = "torch_inductor_jit"
    config_class = TorchInductorJitBackendConfig
    compiles_anything = True
    build_cost = 4.0  # Inductor generates and compiles kernels on the first calls
    warm_imports = INDUCTOR_MODULES
    mutates_inputs = True
    """torch.compile keeps the module's in-place updates of its inputs (a static KV cache)."""
    config: TorchInductorJitBackendConfig

    def __init__(self, config: TorchInductorJitBackendConfig | None = None) -> None:
        super().__init__(config)
        self._compiled: Any = None
        self._cudagraphs = False
        self._cache: InductorCacheSwitch | None = None
        self._watch = RecompileWatch(self.name)

    def unsupported_reason(self, graph: GraphSpec, device: torch.device) -> str | None:
        if self.config.dynamic is False and graph.is_dynamic:
            ranges = ", ".join(f"{n} {r.min}..{r.max}" for n, r in graph.dims.items())
            return (
                f"dynamic=False compiles one static kernel per shape, but this graph has dynamic axes ({ranges}): "
                "calls at sizes not warmed up would compile at run time; use dynamic=None"
            )
        return None

    def build(self, module: torch.nn.Module, context: BuildContext) -> None:
        reason = self.unsupported_reason(context.graph, context.device)
        if reason:
            raise BuildError(reason)
        with inductor_cache(context.cache_dir) as folder:
            self.build_info.update(_count_graph_breaks(module, context.samples[0], self.config))
            if self.build_info["graphs"] == 0:
                raise BuildError(
                    "torch.compile captured no graph from this module (TorchDynamo skips it, as it does "
                    "nn.GRU and nn.LSTM): the result would be eager plus guard checks, so this candidate is "
                    "dropped; try torch_inductor_aot or onnxruntime"
                )
            cases = warmup_cases(context.graph, context.samples)
            foreseen = _foreseen_recompiles(module, context.graph, cases, self.config)
            if foreseen:
                raise BuildError(foreseen)
            self._compile(module, context.graph, context.device, cases)
        self._cache = InductorCacheSwitch(folder)
        self.build_info.update(cache_dir=str(folder), compiled_on_load=False)

    def superseded_by(self, device: torch.device) -> tuple[str, ...]:
        """On the CPU, AOTInductor runs the same Inductor kernels without Dynamo's guards and Python
        wrapper around each call: it was faster on every architecture both built for
        (benchmarks/README.md), while this build's compiles (one per specialized size, 25-30 s on a
        small BERT) are the largest step of a cold tune. Where AOTInductor fails or does not apply
        (a KV cache updated in place, code torch.export refuses) this one is still built. Not
        claimed on CUDA, where it was not measured."""
        return ("torch_inductor_aot",) if device.type == "cpu" else ()

    def follows_weights(self) -> bool:
        """The compiled graph takes the module's parameters as inputs, unless Inductor freezes them."""
        return not (self.config.options or {}).get("freezing", False)

    def infer(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None or self._cache is None:
            raise BuildError("TorchInductorJitBackend used before build() or load()")
        with self._cache, torch.no_grad():
            if self._cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            out = self._watch.call(self._compiled, *args, **kwargs)
        if self._cudagraphs:  # a CUDA graph's outputs are overwritten by its next replay
            leaves, structure = tree.flatten(out)
            out = tree.unflatten(structure, [t.clone() for t in leaves])
        return out

    def save(self, directory: Path) -> dict[str, Any]:
        """Nothing compiled can be saved: the metadata says ``load`` compiles again."""
        return {"format": 1, "compiled": False, "recompile_on_load": True, "torch": torch.__version__}

    def load(self, module: torch.nn.Module, directory: Path, context: LoadContext) -> None:
        graph = context.graph
        base = graph.example("opt")  # random values at the graph's shapes: no sample is saved
        cases = [("graph example at opt", base), *warmup_cases(graph, [base])[1:]]
        with inductor_cache(context.cache_dir) as folder:
            self._compile(module, graph, context.device, cases)
        self._cache = InductorCacheSwitch(folder)
        self.build_info.update(cache_dir=str(folder), compiled_on_load=True)

    # -- compiling ------------------------------------------------------------------------------

    def _compile(
        self, module: torch.nn.Module, graph: GraphSpec, device: torch.device, cases: Sequence[tuple[str, Sample]]
    ) -> None:
        cfg = self.config
        mark = cfg.dynamic is not False and bool(graph.dims)
        dynamic = _dynamic(cfg, graph)
        compiled = torch.compile(
            module,
            backend="inductor",
            options=inductor_options(capped_options(cfg.options), cfg.mode, dynamic),
            dynamic=dynamic,
            fullgraph=cfg.fullgraph,
            **ISOLATED,
        )
        self._cudagraphs = device.type == "cuda" and _uses_cudagraphs(cfg)
        with _building(fail_on_recompile_limit_hit=True), torch.no_grad():
            for label, sample in cases:
                self._warm(compiled, graph, sample, label, mark)
            probe = unseen_sizes(graph, [dim_sizes(graph, s) for _, s in cases]) if mark else None
            if probe is not None:
                self._check_no_recompile(compiled, graph, cases[0][1], probe)
        self._compiled = compiled
        self._watch = RecompileWatch(self.name)  # compiles from here on happen at run time
        self.build_info.update(
            mode=cfg.mode,
            dynamic_dims=sorted(graph.dims) if mark else [],
            warmup_shapes=[label for label, _ in cases],
            device=str(device),
        )

    def _warm(self, compiled: Any, graph: GraphSpec, sample: Sample, label: str, mark: bool) -> None:
        try:
            # CUDA graph trees run a shape once eagerly and record it on a later call: do both here
            for _ in range(3 if self._cudagraphs else 1):
                fresh = sample.fresh()  # a call may update its inputs (a KV cache): the sample stays as recorded
                args, kwargs = _marked(graph, fresh) if mark else (fresh.args, fresh.kwargs)
                if self._cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                compiled(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, torch._dynamo.exc.FailOnRecompileLimitHit):
                raise BuildError(
                    f"TorchDynamo's recompile limit ({torch._dynamo.config.recompile_limit}) for this module's "
                    f"forward was reached in this process while compiling {label}; raise "
                    "torch._dynamo.config.recompile_limit or build fewer variants of this module per process"
                ) from exc
            raise BuildError(
                f"torch.compile (inductor) failed on {label}: {type(exc).__name__}: {_describe(exc)}"
            ) from exc

    def _check_no_recompile(self, compiled: Any, graph: GraphSpec, sample: Sample, sizes: dict[str, int]) -> None:
        """A call at sizes no warm-up used must run the compiled code as it is."""
        label = ", ".join(f"{n}={v}" for n, v in sizes.items())
        probe = resize(graph, sample, sizes)
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                if self._cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                compiled(*probe.args, **probe.kwargs)
        except RuntimeError as exc:
            if "recompile" not in str(exc):
                raise
            raise BuildError(
                f"the compiled module specializes on its dynamic dimensions: a call with {label} would compile "
                f"again at run time ({_describe(exc)}). The module's code fixes these sizes; "
                "build it for static shapes, or pick an exporting backend such as torch_inductor_aot"
            ) from exc
        self.build_info["checked_no_recompile_at"] = label


def _dynamic(cfg: TorchInductorJitBackendConfig, graph: GraphSpec) -> bool | None:
    """``torch.compile``'s ``dynamic``: a graph with step counters (a sliding-window KV cache) gets
    Dynamo's automatic dynamic ints, so a counter seen at two values becomes symbolic and later
    steps reuse the compiled code; other graphs compile static unless ``dynamic=True``."""
    if cfg.dynamic is None and graph.counters:
        return None
    return bool(cfg.dynamic)


def _foreseen_recompiles(
    module: torch.nn.Module,
    graph: GraphSpec,
    cases: Sequence[tuple[str, Sample]],
    cfg: TorchInductorJitBackendConfig,
) -> str | None:
    """Why this build could not win, found before Inductor compiles anything: the module's code fixes
    an axis the recorded calls vary, so calls the graph is tuned for would keep compiling at run time
    until the watch refuses them (:func:`predicted_recompiles`). Tracing with a backend that compiles
    nothing costs a few Dynamo traces against the build's Inductor compiles of every warm-up case.
    """
    if cfg.dynamic is False or not graph.dims:
        return None  # nothing is marked dynamic: unsupported_reason already refused a dynamic graph
    traced = 0

    def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        nonlocal traced
        traced += 1
        return gm.forward

    stand_in = torch.compile(module, backend=record, dynamic=_dynamic(cfg, graph), fullgraph=cfg.fullgraph, **ISOLATED)

    def run(sample: Sample) -> int:
        before = traced
        args, kwargs = _marked(graph, sample.fresh())
        stand_in(*args, **kwargs)
        return traced - before

    try:
        with _building(), torch.no_grad():
            return predicted_recompiles(run, graph, cases)
    except Exception:  # a module Dynamo cannot trace: the build itself says why, with its own message
        return None


def _marked(graph: GraphSpec, sample: Sample) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The sample with the graph's dynamic axes marked for Dynamo, on new tensor objects (the
    recorded tensors stay untouched)."""
    tensors = []
    for t, spec in zip(graph.flatten(sample.args, sample.kwargs), graph.inputs):
        t = t.detach()
        if spec.dynamic_axes:
            torch._dynamo.maybe_mark_dynamic(t, list(spec.dynamic_axes))
        tensors.append(t)
    return graph.unflatten(tensors)


def _count_graph_breaks(module: torch.nn.Module, sample: Sample, cfg: TorchInductorJitBackendConfig) -> dict[str, Any]:
    """Trace once with a backend that only records, to count graph breaks and their reasons.

    A fresh recording backend makes Dynamo trace even when this module class was compiled before
    in the process: Dynamo's cache does not key on ``fullgraph``, so it would otherwise hide the
    breaks (and let ``fullgraph=True`` reuse a split compile). Nothing is compiled here.
    """
    from torch._dynamo.utils import counters

    before = Counter(counters["graph_break"])
    graphs = 0

    def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        nonlocal graphs
        graphs += 1
        return gm.forward

    try:
        with _building(), torch.no_grad():
            traced = torch.compile(
                module, backend=record, dynamic=bool(cfg.dynamic), fullgraph=cfg.fullgraph, **ISOLATED
            )
            fresh = sample.fresh()
            traced(*fresh.args, **fresh.kwargs)
    except Exception as exc:
        if cfg.fullgraph and _is_capture_error(exc):
            raise BuildError(
                f"fullgraph=True, but TorchDynamo cannot capture the module as one graph: {_describe(exc)}. "
                "Remove the graph break from the module, or set fullgraph=False to compile the pieces "
                "(the breaks are then counted in build_info)"
            ) from exc
        raise BuildError(f"TorchDynamo cannot trace the module: {type(exc).__name__}: {_describe(exc)}") from exc
    breaks = Counter(counters["graph_break"]) - before
    reasons = [_first_line(r) + (f" (x{n})" if n > 1 else "") for r, n in breaks.items()]
    return {"graph_breaks": sum(breaks.values()), "break_reasons": reasons, "graphs": graphs}


def _uses_cudagraphs(cfg: TorchInductorJitBackendConfig) -> bool:
    if cfg.options is not None:
        return bool(cfg.options.get("triton.cudagraphs", False))
    return cfg.mode in ("reduce-overhead", "max-autotune")


def _is_capture_error(exc: Exception) -> bool:
    """Errors that mean "Dynamo cannot trace this into one graph" (graph breaks, data dependence)."""
    import torch._dynamo.exc as dexc

    kinds: tuple[type, ...] = (dexc.Unsupported, dexc.UserError)
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return isinstance(exc, (*kinds, GuardOnDataDependentSymNode))


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), text)


def _describe(exc: Exception) -> str:
    """The first line of a Dynamo/Inductor error plus the user code it points at."""
    text = str(exc)
    where = ""
    lines = text.splitlines()
    if "from user code:" in lines:
        after = [ln.strip() for ln in lines[lines.index("from user code:") + 1 :] if ln.strip()]
        if after:
            where = f" at {after[0]}" + (f": {after[1]}" if len(after) > 1 else "")
    return _first_line(text) + where
