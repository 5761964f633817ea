"""``ait.Module``: a drop-in wrapper that records real calls, then runs the tuned winner.

States: ``recording`` (before tuning: calls run eager and, inside ``ait.tune``, are recorded),
``tuned`` (calls go through the dispatcher to each graph's winner) and ``passthrough`` (tuning
kept eager or failed). Attributes, ``state_dict`` keys, ``.to()``, ``eval()`` and forward hooks
behave as on the wrapped module, so wrapping does not change how the rest of a program sees it.
``load_state_dict``, ``.to()`` and ``eval()`` also tell the tuned module's guard to look at the
weights again: winners that baked the old weights in stop being used (see ``guard``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..graph import DynamicShapes
from . import recording
from .guard import RecheckWeights
from .options import AccuracyRule, Metric, check_budget
from .recording import Canonicalizer

if TYPE_CHECKING:
    from ..backend import Tolerance
    from ..report import ModuleReport, TuneReport
    from .dispatch import Dispatcher
    from .strategies import TuneStrategy
    from .winners import Winner

logger = logging.getLogger("aitune")

_INNER = "module"
_torch_module = torch.nn.modules.module  # its global hook dicts, read on every tuned call
_tracing_state = torch._C._get_tracing_state

COMPARE = ("all", "unmasked")
"""How candidates are compared with eager: every output element, or the unmasked positions only."""


class Module(torch.nn.Module):
    """Wrap ``module`` so ``ait.tune`` can tune it; behaves like ``module`` everywhere else.

    ``strategy`` applies to every graph; ``strategies`` gives one per graph, as a list (in the
    order graphs were first recorded) or a mapping from graph index or graph key. ``dynamic_shapes``
    states axes explicitly, per parameter one entry per axis as in AITune,
    ``{"x": (BatchDim("batch", 1, 8), DynamicDim("seq", 1, 512))}``, or ``{axis: dim}``. With
    ``strict=True`` a call outside what was tuned raises instead of running eager.
    ``compare="unmasked"`` checks candidates against eager only at the positions the attention
    mask keeps (the input named ``mask``): padded positions carry no meaning, and backends fill
    them differently, so a left-padded decoder batch would reject them all with ``"all"``.
    ``metric`` and ``accuracy_budget`` judge candidates by the user's own measure (they win over
    ``ait.tune``'s): see :mod:`aitune.metrics`.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        name: str | None = None,
        strategy: TuneStrategy | None = None,
        *,
        strategies: Sequence[TuneStrategy] | Mapping[int | str, TuneStrategy] | None = None,
        dynamic_shapes: DynamicShapes | None = None,
        strict: bool = False,
        tolerances: Mapping[str, Tolerance] | None = None,
        compare: str = "all",
        mask: str = "attention_mask",
        metric: Metric | None = None,
        accuracy_budget: float | None = None,
    ) -> None:
        super().__init__()
        if compare not in COMPARE:
            raise ValueError(f"compare must be one of {COMPARE}, got {compare!r}")
        if isinstance(module, Module):
            raise TypeError(f"{module.name!r} is already wrapped in ait.Module")
        setattr(self, _INNER, module)
        object.__setattr__(self, "name", name or type(module).__name__)
        object.__setattr__(self, "strategy", strategy)
        object.__setattr__(self, "strategies", strategies)
        object.__setattr__(self, "dynamic_shapes", dynamic_shapes)
        object.__setattr__(self, "strict", strict)
        object.__setattr__(self, "tolerances", tolerances)
        object.__setattr__(self, "masked_by", mask if compare == "unmasked" else None)
        object.__setattr__(self, "metric", metric)
        object.__setattr__(self, "accuracy_budget", check_budget(accuracy_budget))
        # how a call is put in the form the graphs were recorded in (recording, install and the plans read it)
        object.__setattr__(self, "canonicalizer", Canonicalizer(module.forward))
        object.__setattr__(self, "_dispatcher", None)
        object.__setattr__(self, "_state", "recording")
        object.__setattr__(self, "tuned_graphs", [])
        object.__setattr__(self, "report", None)
        # how the model's inputs are padded, as ait.tune(pad=...) declared it (kept in the artifact for
        # aitune serve): input name -> pad value; empty when none was declared
        object.__setattr__(self, "pad", {})
        self._register_state_dict_hook(_drop_prefix)
        self._register_load_state_dict_pre_hook(_add_prefix)
        # on the inner module: it runs for load_state_dict on it, on this wrapper and on any parent
        module.register_load_state_dict_post_hook(RecheckWeights(self))

    # -- drop-in behaviour -------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self._modules.get(_INNER)
            if inner is None:
                raise
            return getattr(inner, name)

    @property
    def state(self) -> str:
        return self._state

    @property
    def accuracy(self) -> AccuracyRule:
        """This module's ``metric`` and ``accuracy_budget``: they win over ``ait.tune``'s."""
        return AccuracyRule(self.metric, self.accuracy_budget)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A tuned call goes straight to the dispatcher when ``nn.Module.__call__`` would add nothing
        (no hooks on this wrapper, no global module hooks, not compiled, not traced), which saves
        about a microsecond per call; else torch's path, whose :meth:`forward` dispatches the same."""
        dispatcher = self.direct_dispatcher()
        if dispatcher is None:
            return super().__call__(*args, **kwargs)
        return dispatcher(args, kwargs)

    @property
    def tuned_dispatcher(self) -> Dispatcher | None:
        """What routes this module's calls once tuned; None while it records, or runs eager throughout."""
        return self._dispatcher

    def direct_dispatcher(self) -> Dispatcher | None:
        """The dispatcher, when a call may go straight to it (see :meth:`__call__`); else None."""
        dispatcher = self._dispatcher
        if (
            dispatcher is None
            or self._forward_hooks
            or self._forward_pre_hooks
            or self._backward_hooks
            or self._backward_pre_hooks
            or _torch_module._global_forward_hooks
            or _torch_module._global_forward_pre_hooks
            or _torch_module._global_backward_hooks
            or _torch_module._global_backward_pre_hooks
            or self._compiled_call_impl is not None
            or _tracing_state()
            or recording.bypassing()
        ):
            return None
        return dispatcher

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        dispatcher = self._dispatcher
        if dispatcher is not None and not recording.bypassing():
            return dispatcher(args, kwargs)
        recorded = recording.active_recording()
        if recorded is None or recording.bypassing():
            return self.module(*args, **kwargs)
        before = recorded.before_call(self, args, kwargs)
        out = self.module(*args, **kwargs)
        recorded.record(self, args, kwargs, out, before)
        return out

    def check_weights(self) -> None:
        """Look at the weights again; winners that baked older ones stop being used.

        Runs by itself after ``load_state_dict``, ``.to()`` and ``eval()``; call it after editing
        a weight in place by hand.
        """
        dispatcher = self._dispatcher
        if dispatcher is not None:
            dispatcher.guard.check_weights()

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        out = super()._apply(fn, recurse)  # .to(), .half(), .cuda(), ... on this module or a parent
        self.check_weights()
        return out

    def train(self, mode: bool = True) -> Module:
        out = super().train(mode)
        if not mode:  # back to inference, perhaps after training updated the weights in place
            self.check_weights()
        return out

    def extra_repr(self) -> str:
        return f"name={self.name!r}, state={self._state!r}"

    # -- set by aitune.engine.install, the one way winners are put in place ----------------------

    def hold(
        self, routes: Sequence[Winner], report: ModuleReport | None, dispatcher: Dispatcher | None, state: str
    ) -> None:
        """Keep what :func:`aitune.engine.install.install` (or ``reset``) decided for this wrapper: the
        one place its routes, report, dispatcher and state change."""
        object.__setattr__(self, "tuned_graphs", list(routes))
        object.__setattr__(self, "report", report)
        object.__setattr__(self, "_dispatcher", dispatcher)
        object.__setattr__(self, "_state", state)

    def warnings_kept(self) -> contextlib.AbstractContextManager[None]:
        """Calls made inside (aitune timing the whole model) leave each once-per-reason warning for the
        user's own first call."""
        dispatcher = self._dispatcher
        return dispatcher.warnings_kept() if dispatcher is not None else contextlib.nullcontext()

    def adopt_weights(self) -> str | None:
        """Refit the winners with the module's weights as they are now and check them against eager
        (``ait.load(..., weights="model")``); why they could not (the module then runs eager), or None."""
        dispatcher = self._dispatcher
        return dispatcher.guard.adopt_weights() if dispatcher is not None else None

    @property
    def stale_reason(self) -> str | None:
        """Why the tuned winners no longer match the module's weights, or None when they do."""
        dispatcher = self._dispatcher
        return dispatcher.guard.stale if dispatcher is not None else None

    def offload_weights(self) -> None:
        """Free the eager weights' memory once tuned; calls outside the tuned range then fail.

        Refused when a winner runs on the module's own weights (eager for some graph or batch
        range, ``torch_inductor_jit``): moving them to ``meta`` would break those calls.
        """
        if self._state != "tuned":
            raise RuntimeError(f"{self.name}: only a tuned module can offload its eager weights")
        live = sorted({b.name for _, b in self.tuned_graphs if b.follows_weights()})
        if live:
            raise RuntimeError(
                f"{self.name}: cannot offload the eager weights: {', '.join(live)} runs on them for some "
                "graphs; keep them, or tune with backends that build an engine (onnxruntime, tensorrt, ...)"
            )
        self.module.to("meta")
        dispatcher = self._dispatcher
        if dispatcher is not None:
            dispatcher.guard.accept_weights()  # gone on purpose: the engines hold their own copy


def _drop_prefix(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    inner = prefix + _INNER + "."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_prefix(
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    inner = prefix + _INNER + "."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


def wrapped_modules(obj: Any) -> list[Module]:
    """Every ``ait.Module`` reachable from ``obj``: itself, its submodules, or a pipeline's attributes."""
    return [m for _, m in named_wrapped_modules(obj)]


def named_top_modules(obj: Any) -> list[tuple[str, torch.nn.Module]]:
    """``obj`` when it is a module (path ``""``), else the modules a pipeline object holds, by the
    path ``ait.wrap`` takes: attribute names and mapping keys (two levels deep), list indices."""
    found: list[tuple[str, torch.nn.Module]] = []

    def visit(value: Any, path: str, depth: int) -> None:
        if isinstance(value, torch.nn.Module):
            found.append((path, value))
        elif depth < 2 and isinstance(value, Mapping):
            for k, v in value.items():
                visit(v, f"{path}.{k}" if path else str(k), depth + 1)
        elif depth < 2 and isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(v, f"{path}.{i}" if path else str(i), depth + 1)
        elif depth < 1 and hasattr(value, "__dict__") and not isinstance(value, type):
            for k, v in vars(value).items():
                visit(v, f"{path}.{k}" if path else k, depth + 1)

    visit(obj, "", 0)
    return found


def top_modules(obj: Any) -> list[torch.nn.Module]:
    """The distinct modules of :func:`named_top_modules`."""
    return list({id(m): m for _, m in named_top_modules(obj)}.values())


def named_wrapped_modules(obj: Any) -> list[tuple[str, Module]]:
    """Every ``ait.Module`` reachable from ``obj`` with its dotted path (``""`` for ``obj`` itself).

    Paths are what ``ait.wrap`` takes: child names of modules, attribute names and mapping keys
    of a pipeline, list indices; a wrapper adds no segment of its own.
    """
    found: dict[int, tuple[str, Module]] = {}
    seen: set[int] = set()

    def walk(module: torch.nn.Module, path: str) -> None:
        if id(module) in seen:  # a shared submodule keeps its first path
            return
        seen.add(id(module))
        if isinstance(module, Module):
            found.setdefault(id(module), (path, module))
            module = module.module
        for name, child in module.named_children():
            walk(child, f"{path}.{name}" if path else name)

    for path, module in named_top_modules(obj):
        walk(module, path)
    return list(found.values())


def freeze_tuned(obj: Any, report: TuneReport | None = None) -> None:
    """Make ``obj``'s parameters inference-only (``requires_grad_(False)``) once something in it is tuned.

    All of them, not only the tuned modules': a module upstream whose parameters require grad
    hands the tuned one an activation that requires grad, and that call would run eager. A
    pipeline's modules are found as ``ait.wrap`` finds them (attributes, mappings, lists).
    """
    tuned = [m for m in wrapped_modules(obj) if m.state == "tuned"]
    if not tuned:
        return
    entries = {m.name: m for m in report.modules} if report is not None else {}
    for module in tuned:
        if module.name in entries:
            entries[module.name].frozen = [n for n, p in module.module.named_parameters() if p.requires_grad]
    count = 0
    for root in top_modules(obj):
        for parameter in root.parameters():
            count += parameter.requires_grad
            parameter.requires_grad_(False)
    if count:
        logger.info(
            "%d parameters made inference-only so plain calls run the tuned backends (freeze=False keeps them)", count
        )
