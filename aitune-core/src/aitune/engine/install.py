"""Putting winners in place: the one way a decision becomes what a module's calls run.

The tuner, the ranks (rank 0's winners rebuilt on the others), the artifact reader and the JIT
each call :func:`install` once per module, and :func:`reset` takes a decision away. An
``ait.Module`` holds the dispatcher itself; on a plain module (the JIT tunes those) only the
instance attribute ``forward`` changes, to a :class:`TunedForward`: the module object, its class,
its place in its parent, its ``state_dict`` and its hooks stay as they were.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..builtin.eager import TorchEagerBackend
from . import recording
from .guard import Layout, RecheckWeights
from .module import Module
from .recording import Canonicalizer
from .winners import Winner, dispatcher_for, eager_only

if TYPE_CHECKING:
    from ..report import ModuleReport


def install(
    target: torch.nn.Module,
    winners: Sequence[Winner],
    report: ModuleReport | None,
    *,
    name: str | None = None,
    canonicalize: Canonicalizer | None = None,
    built_with: Layout | None = None,
) -> None:
    """Route ``target``'s inference calls to ``winners``; all eager (or none) leaves it running eager.

    Graphs (or batch ranges) whose winner is eager keep a route to eager, so their calls run eager
    silently instead of counting as calls outside what was tuned. ``built_with``: the weights'
    layout the payloads were built with, when not the module's own now (``ait.load``). ``name``
    and ``canonicalize`` are for a plain module (an ``ait.Module`` has its own).
    """
    routes = [Winner(g, b) for g, b in winners]
    if isinstance(target, Module):
        if eager_only(routes):
            target.hold(routes, report, None, "passthrough")
            return
        inner = target.module
        dispatcher = dispatcher_for(
            target.name, inner, inner, target.canonicalizer, routes, target.strict, inner.modules(), built_with
        )
        target.hold(routes, report, dispatcher, "tuned")
        return
    reset(target)
    if eager_only(routes):
        return
    canonicalize = canonicalize or Canonicalizer(type(target).forward.__get__(target))
    target.forward = TunedForward(target, name or type(target).__name__, canonicalize, routes, report, built_with)


def reset(target: torch.nn.Module) -> None:
    """Take an installed decision away: an ``ait.Module`` records again, a plain module gets its own forward back."""
    if isinstance(target, Module):
        target.hold([], target.report, None, "recording")
        return
    installed = target.__dict__.get("forward")
    if isinstance(installed, TunedForward):
        installed.hook.remove()
        if installed.previous is None:
            del target.__dict__["forward"]
        else:
            target.__dict__["forward"] = installed.previous


class TunedForward:
    """The ``forward`` of a tuned plain module: inference calls go to the winners, the rest run eager.

    Calls the guard stops (training mode, autograd, weights changed by ``load_state_dict`` when
    a winner baked them in) and calls outside the tuned graphs run the module's own forward, and
    the dispatcher warns once per reason.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        name: str,
        canonicalize: Canonicalizer,
        routes: Sequence[Winner],
        report: ModuleReport | None = None,
        built_with: Layout | None = None,
    ) -> None:
        self.previous = module.__dict__.get("forward")
        self._module = weakref.ref(module)
        self._forward = type(module).forward
        self.routes = list(routes)
        self.report = report
        # the module's own hooks run around this forward; its submodules' would not run at all
        submodules = [m for m in module.modules() if m is not module]
        self.dispatcher = dispatcher_for(
            name, module, self._eager, canonicalize, routes, watched=submodules, built_with=built_with
        )
        self.guard = self.dispatcher.guard
        self.hook = module.register_load_state_dict_post_hook(RecheckWeights(self.guard))

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends that serve this module's calls, eager's own left out."""
        return tuple(r.backend.name for r in self.routes if r.backend.name != TorchEagerBackend.name)

    def _eager(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return self._forward(self._module(), *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._module() is None or recording.bypassing():
            return self._eager(*args, **kwargs)
        return self.dispatcher(args, kwargs)
