"""The JIT engine: record modules as the program runs them, then tune them top-down.

Mechanism: two process-wide module hooks from torch's public API
(``torch.nn.modules.module.register_module_forward_pre_hook`` and
``register_module_forward_hook(with_kwargs=True, always_call=True)``). They track how deep the
current call is nested, so a module called from outside any other module's forward is a
top-level candidate, and they record each candidate's inference calls (inputs, kwargs and
outputs) with the same recorder ``ait.tune`` uses. No torch class is patched, and ``disable()``
removes both hooks. While TorchDynamo traces, the hooks return at once, so compiled code never
contains them.

After ``config.min_samples`` calls (or, in deferred mode, at the first call after
``tune.deferred()``) a candidate is tuned with core's own per-module tuner. Tuning works on a
*twin*: a shallow copy sharing the module's parameters, buffers and submodules but not its hooks
or ``forward``, so backends compile the module's own code. The winner is installed by setting
the module's ``forward`` to a :class:`TunedForward` (a dispatcher to each graph's winner); the
module object, its class, its place in its parent, its ``state_dict`` and its hooks are
untouched. A module that stays eager because of graph breaks or because no backend produced a
correct build hands over to its children, down to ``config.max_depth``.

Why one long module: admission, decisions, caching and installation share module-level state
of the running program (the hooks and the decisions made); splitting it by job is left as
follow-up work (issue 22).
"""

from __future__ import annotations

import copy
import logging
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from ...backend import Backend
from ...graph import GraphSpec, Sample, infer_graph
from ...report import ModuleReport
from .. import recording
from ..dispatch import Dispatcher
from ..guard import Guard, RecheckWeights
from ..module import Module
from ..recording import Canonicalizer, RecordingSession
from ..strategies import FirstWinsStrategy, TuneStrategy
from . import config, decision_store

logger = logging.getLogger("aitune")

MAX_SAMPLES = 8
"""Samples kept per graph of a candidate (distinct shapes preferred), as in ``ait.tune``."""
INDUCTOR_JIT = "torch_inductor_jit"

_is_compiling = torch.compiler.is_compiling
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)
_local = threading.local()
_lock = threading.RLock()
_tuning = threading.Lock()
_handles: list[Any] = []
_states: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()
_tuned: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_decisions: list[Decision] = []
_requests = 0
_COMPILE_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"


@attrs.frozen
class Decision:
    """What the JIT did with one module; ``decisions()`` lists them in the order they were made."""

    name: str
    module_class: str
    depth: int
    outcome: str
    """``tuned``, ``eager`` (stays eager, children untouched) or ``descended`` (stays eager, children tried)."""
    backends: tuple[str, ...] = ()
    """The winner of each tuned graph."""
    from_cache: bool = False
    """Installed from a decision remembered by an earlier run, with no tuning and no build."""
    reason: str = ""


@attrs.define(eq=False)
class _Candidate:
    name: str
    depth: int
    twin: torch.nn.Module
    wrapper: Module
    session: RecordingSession
    since: int
    """``deferred()`` requests already made when recording started."""
    calls: int = 0
    warned: bool = False


class TunedForward:
    """The ``forward`` of a tuned module: inference calls go to the winners, the rest run eager.

    Calls the guard stops (training mode, autograd, weights changed by ``load_state_dict`` when
    a winner baked them in) and calls outside the tuned graphs run the module's own forward, and
    the dispatcher warns once per reason.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        name: str,
        canonicalize: Canonicalizer,
        routes: Sequence[tuple[GraphSpec, Any]],
        backends: tuple[str, ...],
        baked: Sequence[str] = (),
    ) -> None:
        self.previous = module.__dict__.get("forward")
        self._module = weakref.ref(module)
        self._forward = type(module).forward
        self.backends = backends
        self.guard = Guard(module, baked)
        self.dispatcher = Dispatcher(name, self._eager, canonicalize, routes, guard=self.guard)
        self.hook = module.register_load_state_dict_post_hook(RecheckWeights(self.guard))

    def _eager(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return self._forward(self._module(), *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._module() is None or recording.bypassing():
            return self._eager(*args, **kwargs)
        return self.dispatcher(args, kwargs)


# -- switching on and off -----------------------------------------------------------------------


def enable() -> None:
    """Turn JIT tuning on for this process (idempotent)."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    with _lock:
        if _handles:
            return
        _handles.append(register_module_forward_pre_hook(_pre))
        _handles.append(register_module_forward_hook(_post, with_kwargs=True, always_call=True))
        # torch warns that global hooks also fire for torch.compile's wrapper module; the hooks
        # here skip that wrapper, so the warning (raised by every compiling backend) is noise
        warnings.filterwarnings("ignore", message=_COMPILE_WARNING, category=UserWarning)
        logger.debug("aitune jit: enabled")


def enabled() -> bool:
    return bool(_handles)


def disable() -> None:
    """Turn JIT tuning off: remove the hooks, give tuned modules their own forward back, forget everything."""
    global _requests
    with _lock:
        for handle in _handles:
            handle.remove()
        _handles.clear()
        for entry in [f for f in warnings.filters if f[1] is not None and f[1].pattern == _COMPILE_WARNING]:
            warnings.filters.remove(entry)  # type: ignore[attr-defined]
        for module in list(_tuned):
            installed = module.__dict__.get("forward")
            if isinstance(installed, TunedForward):
                installed.hook.remove()
                if installed.previous is None:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = installed.previous
        _tuned.clear()
        _states.clear()
        _decisions.clear()
        _requests = 0
        _local.depth = 0


def decisions() -> list[Decision]:
    """Every decision made in this process so far, oldest first."""
    return list(_decisions)


def request_tuning() -> None:
    """Tune every module recorded so far at its next forward call (see ``tune.deferred``)."""
    global _requests
    with _lock:
        _requests += 1


# -- the hooks ----------------------------------------------------------------------------------


def _pre(module: torch.nn.Module, args: Any) -> None:
    if _is_compiling() or _is_exporting():
        return
    _local.depth = getattr(_local, "depth", 0) + 1


def _post(module: torch.nn.Module, args: Any, *rest: Any) -> None:
    if _is_compiling() or _is_exporting():
        return
    depth = _local.depth = max(getattr(_local, "depth", 1) - 1, 0)
    if len(rest) != 2 or recording.bypassing():  # forward raised (always_call), or aitune itself is running it
        return
    entry = _states.get(module)
    if entry is None:
        if depth:
            return
        entry = _admit(module, type(module).__name__, 0)
    if type(entry) is _Candidate:
        _observe(module, entry, args, rest[0], rest[1])


# -- recording ----------------------------------------------------------------------------------


def _skip_reason(module: torch.nn.Module, name: str) -> str | None:
    cls = type(module)
    if isinstance(module, Module):
        return "it is an ait.Module (tuned ahead of time)"
    if cls.__module__.startswith("torch._dynamo") or isinstance(module, torch.jit.ScriptModule):
        return "it is already compiled (torch.compile or TorchScript)"
    if cls.forward is torch.nn.Module.forward:
        return "it has no forward"
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    for prefix in config.exclude:
        if cls.__name__.startswith(prefix) or qualified.startswith(prefix) or name.startswith(prefix):
            return f"excluded by {prefix!r}"
    count = sum(p.numel() for p in module.parameters())
    if count < config.min_parameters:
        return f"{count} parameters, fewer than min_parameters={config.min_parameters}"
    return None


def _twin(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy that shares parameters, buffers and submodules, without hooks or a patched forward."""
    twin = copy.copy(module)
    hooks = ("_forward_", "_backward_", "_state_dict_", "_load_state_dict_")
    for name, value in list(vars(module).items()):
        if name.startswith(hooks) and isinstance(value, dict):
            twin.__dict__[name] = type(value)()
        elif name.startswith(hooks) and isinstance(value, set):
            twin.__dict__[name] = set()
    if isinstance(twin.__dict__.get("forward"), TunedForward):
        del twin.__dict__["forward"]
    return twin


def _admit(module: torch.nn.Module, name: str, depth: int) -> Any:
    reason = _skip_reason(module, name)
    if reason:
        logger.debug("aitune jit: not tuning %s: %s", name, reason)
        _states[module] = "skipped"
        return "skipped"
    twin = _twin(module)
    candidate = _Candidate(name, depth, twin, Module(twin, name), RecordingSession(MAX_SAMPLES), _requests)
    _states[module] = candidate
    return candidate


def _inputs_need_grad(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    values = list(args) + list(kwargs.values())
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def _observe(module: torch.nn.Module, cand: _Candidate, args: Any, kwargs: Any, output: Any) -> None:
    if module.training or (
        torch.is_grad_enabled()
        and (_inputs_need_grad(args, kwargs) or any(p.requires_grad for p in module.parameters()))
    ):
        if not cand.warned:
            cand.warned = True
            logger.warning(
                "aitune jit: %s runs in training mode or with autograd on; JIT tuning covers inference only: "
                "call model.eval() and run it under torch.inference_mode() or torch.no_grad()",
                cand.name,
            )
        return
    cand.session.record(cand.wrapper, args, kwargs, output)
    cand.calls += 1
    ready = _requests > cand.since or (not config.deferred and cand.calls >= config.min_samples)
    if ready and _tuning.acquire(blocking=False):
        try:
            _tune(module, cand)
        finally:
            _tuning.release()


# -- deciding -----------------------------------------------------------------------------------


def _tune(module: torch.nn.Module, cand: _Candidate) -> None:
    _states[module] = "tuning"
    try:
        with torch.no_grad(), recording.bypass():
            decision = _decide(module, cand)
    except Exception as exc:  # the JIT never breaks the program it tunes
        logger.warning("aitune jit: tuning %s failed (%s: %s); it runs eager", cand.name, type(exc).__name__, exc)
        _states[module] = "eager"
        decision = _decision(module, cand, "eager", reason=f"{type(exc).__name__}: {exc}")
    _decisions.append(decision)


def _decision(module: torch.nn.Module, cand: _Candidate, outcome: str, **kwargs: Any) -> Decision:
    cls = type(module)
    return Decision(cand.name, f"{cls.__module__}.{cls.__qualname__}", cand.depth, outcome, **kwargs)


def _decide(module: torch.nn.Module, cand: _Candidate) -> Decision:
    rec = cand.session.modules[id(cand.wrapper)]
    graphs = list(rec.graphs.values())
    broken = next((g.error for g in graphs if g.error), None)
    if broken:
        return _descend(module, cand, f"a recorded call cannot be tuned: {broken}")
    device = _device_of(cand.twin)
    strategy, candidates = _strategy(device)
    specs = [infer_graph(g.samples, cand.wrapper._canonicalize.arg_names, None, None, g.outputs) for g in graphs]
    key = None
    if config.remember:
        key = decision_store.decision_key(cand.twin, specs, device, repr(strategy), candidates)
        remembered = decision_store.load(key, cand.name, cand.twin, specs, device)
        if remembered is not None:
            wrong = _stale_winner(cand, graphs, remembered)
            if wrong is None:
                return _reuse(module, cand, remembered)
            logger.warning(
                "aitune jit: the remembered winner for %s no longer matches the module (%s); tuning it again",
                cand.name,
                wrong,
            )
            decision_store.forget(key)
    if config.detect_graph_breaks:
        for g in graphs:
            reason = graph_break_reason(cand.twin, g.samples[0])
            if reason:
                why = f"TorchDynamo cannot capture it as one graph: {reason}"
                _remember(key, cand, "descended", why)
                logger.info("aitune jit: %s stays eager (%s); trying its children", cand.name, why)
                return _descend(module, cand, why)
    from ..tuner import tune_recorded

    object.__setattr__(cand.wrapper, "strategy", strategy)
    report = tune_recorded(rec, device, None, candidates, None, False)
    winners = list(cand.wrapper.tuned_graphs)
    if cand.wrapper.state == "tuned":
        names = _install(module, cand, winners)
        _remember(key, cand, "tuned", report.summary, winners)
        logger.info("aitune jit: tuned %s", report.summary)
        return _decision(module, cand, "tuned", backends=names, reason=report.summary)
    why = report.error or "; ".join(g.reason for g in report.graphs if g.reason) or report.summary
    if report.status == "failed" or not _any_correct(report):
        _remember(key, cand, "descended", why)
        logger.info("aitune jit: %s stays eager (%s); trying its children", cand.name, why)
        return _descend(module, cand, why)
    _remember(key, cand, "eager", why)
    logger.info("aitune jit: %s stays eager: %s", cand.name, why)
    _states[module] = "eager"
    return _decision(module, cand, "eager", reason=why)


def _stale_winner(cand: _Candidate, graphs: Sequence[Any], remembered: decision_store.Remembered) -> str | None:
    """Why a remembered winner is wrong for the module as it is now (checked on the recorded calls), or None."""
    from ...plugins import get_manager

    hook = get_manager().hook
    recorded = [s for g in graphs for s in g.samples]
    for graph, backend in remembered.winners:
        if backend is None:
            continue
        samples = [s for s in recorded if graph.mismatch(s.tensors()) is None] or [graph.example("opt")]
        result = hook.aitune_validate(
            backend=backend, reference=cand.twin, samples=samples, graph=graph, tolerances=None
        )
        if not result.passed:
            return f"{backend.name}: {result.reason}"
    return None


def _reuse(module: torch.nn.Module, cand: _Candidate, remembered: decision_store.Remembered) -> Decision:
    if remembered.outcome == "tuned":
        names = _install(module, cand, [(g, b) for g, b in remembered.winners if b is not None])
        logger.info("aitune jit: reusing tuned %s (%s) from cache", cand.name, ", ".join(dict.fromkeys(names)))
        return _decision(module, cand, "tuned", backends=names, from_cache=True, reason=remembered.reason)
    if remembered.outcome == "descended":
        logger.info("aitune jit: reusing decision for %s from cache: stays eager, trying its children", cand.name)
        return _descend(module, cand, remembered.reason, from_cache=True)
    logger.info("aitune jit: reusing decision for %s from cache: stays eager", cand.name)
    _states[module] = "eager"
    return _decision(module, cand, "eager", from_cache=True, reason=remembered.reason)


def _remember(
    key: str | None, cand: _Candidate, outcome: str, reason: str, winners: Sequence[tuple[GraphSpec, Backend]] = ()
) -> None:
    if key is not None:
        decision_store.save(key, cand.name, outcome, reason, winners)


def _descend(module: torch.nn.Module, cand: _Candidate, why: str, from_cache: bool = False) -> Decision:
    _states[module] = "descended"
    if cand.depth >= config.max_depth:
        return _decision(
            module, cand, "eager", from_cache=from_cache, reason=f"{why}; max_depth={config.max_depth} reached"
        )
    for path, child in _children(module):
        if child not in _states:
            _admit(child, f"{cand.name}.{path}", cand.depth + 1)
    return _decision(module, cand, "descended", from_cache=from_cache, reason=why)


def _install(
    module: torch.nn.Module, cand: _Candidate, winners: Sequence[tuple[GraphSpec, Backend]]
) -> tuple[str, ...]:
    routes = [(g, b.infer) for g, b in winners if b.name != decision_store.EAGER]
    names = tuple(b.name for g, b in winners if b.name != decision_store.EAGER)
    baked = [b.name for g, b in winners if not b.follows_weights()]
    module.forward = TunedForward(module, cand.name, cand.wrapper._canonicalize, routes, names, baked)
    _tuned.add(module)
    _states[module] = "tuned"
    return names


# -- helpers ------------------------------------------------------------------------------------


def graph_break_reason(module: torch.nn.Module, sample: Sample) -> str | None:
    """Why TorchDynamo cannot capture ``module`` as one graph on ``sample``, or None when it can.

    Traces with ``fullgraph=True`` and a backend that compiles nothing. Unlike
    ``torch._dynamo.explain`` it does not reset Dynamo, so modules compiled earlier stay compiled.
    """
    import torch._dynamo

    dynamo = torch._dynamo.config
    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"

    def capture(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return gm.forward

    try:
        with dynamo.patch(**{name: max(getattr(dynamo, name), 256)}), torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*global hooks on modules", category=UserWarning)
            torch.compile(module, backend=capture, fullgraph=True)(*sample.args, **sample.kwargs)
    except Exception as exc:
        text = str(exc).strip()
        return next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    return None


def _strategy(device: torch.device) -> tuple[TuneStrategy, list[Backend]]:
    """The strategy for a module on ``device`` and the candidate backends it will try, in order."""
    from ..tuner import default_backends

    strategy = config.strategy
    if strategy is None:
        if config.backends is not None:
            from ...plugins import get_manager

            registry = get_manager().registry
            strategy = FirstWinsStrategy([registry.backend_class(n)() for n in config.backends])
        else:
            # the Inductor JIT compiles almost anything, so it is the fallback behind the exporting backends
            ordered = sorted(default_backends(device), key=lambda b: b.name == INDUCTOR_JIT)
            strategy = FirstWinsStrategy(ordered)
    defaults = default_backends(device) if strategy.backends is None else []
    return strategy, strategy.candidates(defaults)


def _any_correct(report: ModuleReport) -> bool:
    return any(c.validation is not None and c.validation.passed for g in report.graphs for c in g.candidates)


def _children(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """Direct children, looking through containers that have no forward (ModuleList, ModuleDict)."""
    for name, child in module.named_children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            yield from _children(child, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", child


def _device_of(module: torch.nn.Module) -> torch.device:
    for param in module.parameters():
        return param.device
    for buffer in module.buffers():
        return buffer.device
    return torch.device("cpu")
