"""Putting winners in place: a tuned module's ``forward`` becomes a :class:`TunedForward`.

Only the instance attribute ``forward`` changes; the module object, its class, its place in its
parent, its ``state_dict`` and its hooks stay as they were, and :func:`uninstall` gives the module
its own forward back.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ...backend import Backend
from ...graph import GraphSpec
from .. import recording
from ..guard import RecheckWeights
from ..install import Winner, dispatcher_for
from ..recording import Canonicalizer
from . import decision_store
from .state import STATE, JitCandidate


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
        routes: Sequence[Winner],
        backends: tuple[str, ...],
    ) -> None:
        self.previous = module.__dict__.get("forward")
        self._module = weakref.ref(module)
        self._forward = type(module).forward
        self.backends = backends
        # the module's own hooks run around this forward; its submodules' would not run at all
        submodules = [m for m in module.modules() if m is not module]
        self.dispatcher = dispatcher_for(name, module, self._eager, canonicalize, routes, watched=submodules)
        self.guard = self.dispatcher.guard
        self.hook = module.register_load_state_dict_post_hook(RecheckWeights(self.guard))

    def _eager(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return self._forward(self._module(), *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._module() is None or recording.bypassing():
            return self._eager(*args, **kwargs)
        return self.dispatcher(args, kwargs)


def install(
    module: torch.nn.Module, cand: JitCandidate, winners: Sequence[tuple[GraphSpec, Backend]]
) -> tuple[str, ...]:
    """Route ``module``'s inference calls to ``winners`` (eager ones run its own forward); returns the backends used."""
    routes = [Winner(g, b) for g, b in winners]
    names = tuple(b.name for g, b in winners if b.name != decision_store.EAGER)
    module.forward = TunedForward(module, cand.name, cand.wrapper._canonicalize, routes, names)
    STATE.tuned.add(module)
    STATE.modules[module] = "tuned"
    return names


def uninstall(module: torch.nn.Module) -> None:
    """Give a tuned module the ``forward`` it had before :func:`install`."""
    installed = module.__dict__.get("forward")
    if isinstance(installed, TunedForward):
        installed.hook.remove()
        if installed.previous is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = installed.previous
