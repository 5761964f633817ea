"""When a tuned module must run eager: training, autograd, and weights changed since tuning.

Tuned backends compute no gradients and run the module as it was in eval mode, and most copy
the weights into their engine when they build. A call that needs any of that runs the module's
own forward instead. The per-call check is ordered cheapest first: under ``torch.no_grad()`` or
``torch.inference_mode()`` in eval mode it is one function call and two attribute reads.

Changed weights are noticed when they change through ``load_state_dict`` (on the module or any
parent), ``.to()``/``.half()``/``.cuda()`` and a switch back to eval mode (after training);
checking every tensor's version counter on every call would cost more than the dispatch itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InferenceOnlyError, StaleWeightsError
from ..module_code import reads_training

TRAINING = (
    "it is in training mode and its code reads self.training (Dropout, BatchNorm, ...), while tuned "
    "backends run it as in eval mode; call model.eval() for inference"
)
NEEDS_GRAD = (
    "grad mode is on and an input or a parameter requires grad, and tuned backends compute no gradients; "
    "call it under torch.inference_mode() or torch.no_grad() for inference (or freeze the parameters)"
)


def weights_stamp(module: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """Where each weight lives and how often it was written in place: changes when any weight does."""
    return tuple((t.data_ptr(), t._version) for t in module.state_dict(keep_vars=True).values())


class Guard:
    """Why a call of a tuned module must run eager, or None; built when the winners are installed.

    ``baked`` names the installed backends that copied the weights in: when the weights change,
    only those make the module stale (a backend that reads the live weights follows them).
    """

    def __init__(self, module: torch.nn.Module, baked: Sequence[str]) -> None:
        self._module = weakref.ref(module)
        self.training_matters = reads_training(module)
        self.baked = tuple(dict.fromkeys(baked))
        self.params = tuple(module.parameters())
        self.stamp = weights_stamp(module)
        self.stale: str | None = None

    def check_weights(self) -> None:
        """Re-read the weights (after load_state_dict, .to(), eval()); baked winners go stale when they changed."""
        module = self._module()
        if module is None:
            return
        self.params = tuple(module.parameters())
        stamp = weights_stamp(module)
        if stamp != self.stamp and self.baked and self.stale is None:
            self.stale = (
                f"its weights changed since it was tuned (load_state_dict, .to() or an in-place update) and "
                f"{', '.join(self.baked)} baked the old ones in; run ait.tune again to tune the new weights"
            )

    def accept_weights(self) -> None:
        """Take the weights as they are now as the tuned ones (after offloading them on purpose)."""
        module = self._module()
        if module is not None:
            self.params = tuple(module.parameters())
            self.stamp = weights_stamp(module)

    def blocked(self, leaves: Sequence[torch.Tensor]) -> tuple[str, type[Exception]] | None:
        """The reason this call must run eager and the error strict mode raises, or None."""
        if self.stale is not None:
            return self.stale, StaleWeightsError
        if self.training_matters:
            module = self._module()
            if module is not None and module.training:
                return TRAINING, InferenceOnlyError
        if torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.params) or any(t.requires_grad for t in leaves)
        ):
            return NEEDS_GRAD, InferenceOnlyError
        return None


class RecheckWeights:
    """A ``load_state_dict`` post-hook: ``owner.check_weights()`` while the owner lives.

    A class rather than a closure so the module it hangs on still pickles (``torch.save(model)``);
    weakrefs do not pickle, so a pickled copy's hook does nothing.
    """

    def __init__(self, owner: object) -> None:
        self._owner: weakref.ref[Any] | None = weakref.ref(owner)

    def __call__(self, module: torch.nn.Module, incompatible_keys: object) -> None:
        owner = self._owner() if self._owner is not None else None
        if owner is not None:
            owner.check_weights()

    def __getstate__(self) -> dict[str, Any]:
        return {"_owner": None}
