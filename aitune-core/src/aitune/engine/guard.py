"""When a tuned module must run eager: training, autograd, and weights changed since tuning.

Tuned backends compute no gradients and run the module as it was in eval mode, and most copy
the weights into their engine when they build. A call that needs any of that runs the module's
own forward instead. The per-call check is ordered cheapest first: under ``torch.no_grad()`` or
``torch.inference_mode()`` in eval mode it is one function call and a few attribute reads (about
0.14 us, the same with the weight watching below as without it).

Changed weights are noticed when they change through ``load_state_dict`` (on the module or any
parent), ``.to()``/``.half()``/``.cuda()`` and a switch back to eval mode (after training), and
through what no call of the module announces: a new ``Parameter``, buffer or submodule set on it
or a submodule, and an optimizer step over its weights (torch's global registration and
optimizer-step hooks, registered once per process by the first guard whose winners baked weights
in; they hold guards weakly and only mark them). A marked guard looks at the weights on its next
call that would run tuned, so a training loop pays nothing per step. Winners that baked the
weights in are then refitted with the new ones (``Backend.refit``) and checked against eager on
the graph's min, opt and max shapes; only where that fails does the module run eager.
The stamp those checks compare includes a digest of every weight's bytes, so an edit through
``.data`` (which has a version counter of its own) or a newly assigned tensor is seen too.
Reading every weight's version counter on every call would catch a hand edit in place
(``p.add_(1)`` under ``no_grad``) at once, but costs about 56 ns per weight, ten times the
dispatch itself for 200 weights; such an edit is seen at ``eval()`` or ``check_weights()``.

Hooks added after tuning to a module a tuned backend replaces (the wrapped module, any submodule)
would not run: :class:`HookWatch` sees each change to those modules' hook dicts as it is made, so
the per-call check is one attribute read, and such calls run eager until the hooks are removed.
A hook that acts only on some calls, where aitune can tell which, sends only those calls eager:
transformers 5 installs output-capturing hooks the first time a model is called with
``output_hidden_states=True`` or ``output_attentions=True``, and each records only while its
model's forward has put a collector holding its key in a context variable; the guard reads that
variable (about 0.1 us, paid only once such hooks exist), so later plain calls run tuned again.
Such hooks present while tuning get the same per-call look: a tuned backend never records.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import logging
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import HooksChangedError, InferenceOnlyError, StaleWeightsError
from ..module_code import reads_training

if TYPE_CHECKING:
    from ..backend import Backend
    from ..graph import GraphSpec

logger = logging.getLogger("aitune")

TRAINING = (
    "it is in training mode and its code reads self.training (Dropout, BatchNorm, ...), while tuned "
    "backends run it as in eval mode; call model.eval() for inference"
)
NEEDS_GRAD = (
    "grad mode is on and an input or a parameter requires grad, and tuned backends compute no gradients; "
    "call it under torch.inference_mode() or torch.no_grad() for inference (or freeze the parameters)"
)


HOOKS = (
    "hooks were added to it or to a submodule after tuning (or hooks it had were removed), and a tuned backend "
    "does not run the module's own forward; it runs eager until the hooks are as they were when it was tuned"
)
CAPTURING = (
    "transformers records outputs inside it on this call (output_hidden_states or output_attentions), through "
    "hooks a tuned backend does not run; calls that ask for them run eager, the others run tuned"
)
CHANGING = (
    "its weights kept changing while aitune read them (an optimizer stepping in another thread?), so this call "
    "cannot be checked against the weights a tuned backend holds"
)
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


Stamp = tuple[tuple[tuple[int, int], ...], str]
"""Where each weight lives and how often it was written in place, and a digest of every weight's bytes."""


def weights_stamp(module: torch.nn.Module) -> Stamp:
    """Where each weight lives, how often it was written in place, and a BLAKE2b digest of their bytes.

    The digest catches what the other two cannot: ``p.data.mul_(2)`` or two rows swapped through
    ``.data`` write through a tensor with its own version counter. A digest and not a sum, so a
    permutation of the same values is seen too. One pass over the weights (copied to the host when on
    a GPU), taken at install and when something asks to look at them again (never per call). BLAKE2b
    and not SHA-256: SHA-256 was twice as fast on the development machine (3.5 against 7.1 ms for
    6 MB), whose CPU computes it in hardware, and 1.7x slower than BLAKE2b there with those
    instructions masked from OpenSSL (``OPENSSL_ia32cap``), as on Intel server CPUs before Ice Lake,
    which many GPU servers still carry.
    """
    tensors = [t.detach() for t in module.state_dict(keep_vars=True).values()]
    digest = hashlib.blake2b(digest_size=16)
    for t in tensors:
        _feed(digest, t)
    return tuple((t.data_ptr(), t._version) for t in tensors), digest.hexdigest()


def _feed(digest: Any, t: torch.Tensor) -> None:
    digest.update(f"{t.dtype}{tuple(t.shape)}{t.device.type};".encode())
    if t.device.type == "meta" or t.numel() == 0 or t.is_sparse or t.layout != torch.strided:
        return
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    digest.update(raw.cpu().numpy().data)


Layout = dict[str, tuple[torch.dtype, tuple[int, ...], torch.device]]
"""Each weight's dtype, shape and device: what a payload that baked the weights in was built with."""


def weights_layout(weights: Mapping[str, torch.Tensor]) -> Layout:
    return {name: (t.dtype, tuple(t.shape), t.device) for name, t in weights.items()}


def layout_mismatch(weights: Mapping[str, torch.Tensor], built_with: Layout) -> str | None:
    """How ``weights`` differ in dtype, shape or device from what the payload was built with, or None.

    Checked before any weight reaches a backend's ``refit``: a native runtime (AOTInductor's
    ``load_constants``, TensorRT's refitter) copies bytes by the layout it was compiled for, so a
    float64 or resized tensor there corrupts memory instead of raising.
    """
    for name, (dtype, shape, device) in built_with.items():
        t = weights.get(name)
        if t is None:
            return f"the weight {name} is missing"
        if t.dtype != dtype or tuple(t.shape) != shape or not _same_device(t.device, device):
            return (
                f"{name} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device}, and the payload was "
                f"built with {str(dtype).removeprefix('torch.')} {list(shape)} on {device}"
            )
    return None


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class _WatchedHooks(collections.OrderedDict):
    """A module's hook dict that tells its watches when a hook is added or removed."""

    def __init__(self, *args: Any) -> None:
        # before the items: filling the dict calls __setitem__, which tells the watches
        self.watches: weakref.WeakSet[HookWatch] = weakref.WeakSet()
        super().__init__(*args)

    def _changed(self) -> None:
        for watch in list(self.watches):
            watch.recheck(self)

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self._changed()

    def pop(self, *args: Any) -> Any:
        out = super().pop(*args)
        self._changed()
        return out

    def clear(self) -> None:
        super().clear()
        self._changed()

    def __reduce__(self) -> Any:  # a pickled or deep-copied module gets plain hook dicts
        return (collections.OrderedDict, (list(self.items()),))


def capture_key(hook: object) -> tuple[Any, str] | None:
    """The context variable and the key a transformers output-capturing hook records under, or None.

    transformers 5 (``utils/output_capturing.py``) installs ``output_capturing_hook`` on the layers
    of a model the first time it is asked for hidden states or attentions; the hook returns at once
    unless ``_active_collector.get()`` is a dict holding its key, which the model's
    ``@capture_outputs`` forward sets only for a call that asks for that output. Any other hook,
    or one of another shape (another transformers version), is None: it is taken to act on every call.
    """
    if not isinstance(hook, types.FunctionType):
        return None
    code = hook.__code__
    if (
        code.co_name != "output_capturing_hook"
        or hook.__module__ != "transformers.utils.output_capturing"
        or "_active_collector" not in code.co_names
        or hook.__closure__ is None
    ):
        return None
    try:
        key = hook.__closure__[code.co_freevars.index("key")].cell_contents
        collector = hook.__globals__["_active_collector"]
    except (ValueError, IndexError, KeyError):  # an empty cell raises ValueError too
        return None
    if not isinstance(key, str) or not callable(getattr(collector, "get", None)):
        return None
    return collector, key


class HookWatch:
    """Whether the hooks of ``modules`` still are what they were when the watch began (``changed``),
    and whether a hook a tuned backend skips acts on the call being made (:meth:`acting`).

    Hooks present at the start are the module's own (validation compared against them), except
    transformers' output-capturing hooks: those record on calls that ask for hidden states or
    attentions, which a tuned backend cannot, so such calls run eager whenever the hooks came.
    """

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        self._baseline: list[tuple[_WatchedHooks, frozenset[Any]]] = []
        for module in modules:
            for name in HOOK_DICTS:
                hooks = module.__dict__.get(name)
                if hooks is None:
                    continue
                if not isinstance(hooks, _WatchedHooks):
                    hooks = _WatchedHooks(hooks)
                    module.__dict__[name] = hooks
                hooks.watches.add(self)
                self._baseline.append((hooks, frozenset(hooks)))
        self._by_id = {id(hooks): (hooks, keys) for hooks, keys in self._baseline}
        self._states: dict[int, tuple[bool, frozenset[tuple[Any, str]]]] = {}
        """Per hook dict (by id) that needs a look per call: whether it differs from its baseline other
        than by capture hooks added, and the (collector, key) of each capture hook it holds."""
        self._always = False
        self._captures: tuple[tuple[Callable[[], Any], frozenset[str]], ...] = ()
        self.changed = False
        """Read on every call: some hook may act on it (then :meth:`acting` says whether one does)."""
        self.recheck()

    def recheck(self, hooks: _WatchedHooks | None = None) -> None:
        """Judge ``hooks`` (every watched dict when None) against its baseline; runs when a hook is
        added or removed, never per call."""
        if hooks is None:
            judged = self._baseline
        else:  # only the dict that changed: a model installing a hook per layer pays once per hook
            entry = self._by_id.get(id(hooks))
            judged = [entry] if entry is not None and entry[0] is hooks else []
        for watched, keys in judged:
            now = frozenset(watched)
            always = False
            captures: set[tuple[Any, str]] = set()
            for key in now:
                found = capture_key(watched.get(key))
                if found is not None:
                    captures.add(found)
                elif key not in keys:
                    always = True  # an added hook that may act on any call
            always = always or not keys <= now
            if always or captures:
                self._states[id(watched)] = (always, frozenset(captures))
            else:
                self._states.pop(id(watched), None)
        states = list(self._states.values())
        grouped: dict[Any, set[str]] = {}
        for collector, key in (found for _, captures in states for found in captures):
            grouped.setdefault(collector, set()).add(key)
        self._always = any(always for always, _ in states)
        self._captures = tuple((collector.get, frozenset(keys)) for collector, keys in grouped.items())
        self.changed = bool(self._states)  # last: a call that reads it sees the rest already set

    def acting(self) -> str | None:
        """Why a hook makes this call run eager, or None when none acts on it (transformers' capture
        hooks outside a call that asks for their output)."""
        if self._always:
            return HOOKS
        for get, keys in self._captures:
            active = get()
            if active and not keys.isdisjoint(active):
                return CAPTURING
        return None

    def rebased(self, modules: Iterable[torch.nn.Module]) -> HookWatch:
        """A watch on ``modules`` (copies of the watched ones, in the same order) that compares them
        with this watch's baseline."""
        new = HookWatch(modules)
        if len(new._baseline) == len(self._baseline):
            new._baseline = [(hooks, keys) for (hooks, _), (_, keys) in zip(new._baseline, self._baseline)]
            new._by_id = {id(hooks): (hooks, keys) for hooks, keys in new._baseline}
            new.recheck()
        return new


class Guard:
    """Why a call of a tuned module must run eager, or None; built when the winners are installed.

    ``baked`` names the installed backends that copied the weights in: when the weights change,
    only those make the module stale (a backend that reads the live weights follows them).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        baked: Sequence[str],
        watched: Iterable[torch.nn.Module] = (),
        *,
        refittable: Sequence[tuple[GraphSpec, Backend]] = (),
        reference: Callable[..., Any] | None = None,
        built_with: Layout | None = None,
    ) -> None:
        self._module = weakref.ref(module)
        self.hooks = HookWatch(watched)
        self.training_matters = reads_training(module)
        self.baked = tuple(dict.fromkeys(baked))
        self.refittable = tuple(refittable)
        """The winners that baked the weights in, each with its graph: refitted when the weights change."""
        self.reference = reference
        """The module's own forward, the eager answer a refitted winner is checked against."""
        self.params = tuple(module.parameters())
        self.stamp = weights_stamp(module)
        self._stale: str | None = None
        self._pending = False
        """Something changed the weights without a call aitune watches (a new Parameter, an optimizer
        step): look at them before the next call that would run tuned."""
        self.alert = False
        """Read on every call: stale, or weights to look at again (one read for both on the fast path)."""
        self._lock = threading.RLock()
        self.module_ids: frozenset[int] = frozenset()
        self.weight_ids: frozenset[int] = frozenset()
        self.built_with = built_with if built_with is not None else weights_layout(module.state_dict())
        """What the baked winners were built with (the module's weights now, or what ``ait.load`` says):
        weights of another dtype, shape or device are never handed to ``refit``."""
        if self.baked:
            self._note_ids(module)
            _watch(self)

    @property
    def stale(self) -> str | None:
        """Why the baked winners no longer match the weights (the module then runs eager), or None."""
        return self._stale

    @stale.setter
    def stale(self, reason: str | None) -> None:
        self._stale = reason
        self.alert = reason is not None or self._pending

    def recheck(self) -> None:
        """Look at the weights again before the next call that would run tuned (torch's global hooks
        call this; cheap: it only marks)."""
        self._pending = True
        self.alert = True

    def _note_ids(self, module: torch.nn.Module) -> None:
        """Which modules and weights the global hooks match against this guard (by ``id``: a false
        match after an id is reused only costs one look at the weights)."""
        self.module_ids = frozenset(map(id, module.modules()))
        self.weight_ids = frozenset(map(id, module.state_dict(keep_vars=True).values()))

    def __deepcopy__(self, memo: dict[int, Any]) -> Guard:
        """A copy that watches the copied module's weights and hooks (``copy.deepcopy`` of a tuned
        module), not the original's."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key == "_lock":
                new._lock = threading.RLock()
            else:
                new.__dict__[key] = value if key in ("_module", "hooks") else copy.deepcopy(value, memo)
        module = self._module()
        if module is None:
            new.hooks = HookWatch(())
            return new
        copied = copy.deepcopy(module, memo)
        new._module = weakref.ref(copied)
        new.hooks = self.hooks.rebased(copied.modules())
        if new.baked:
            new._note_ids(copied)
            _watch(new)
        return new

    def check_weights(self) -> None:
        """Re-read the weights (after load_state_dict, .to(), eval(), or before the first tuned call
        after a new Parameter or an optimizer step); when they changed, winners that baked them in
        are refitted with the new ones and checked against eager, and go stale where that fails."""
        module = self._module()
        if module is None:
            return
        with self._lock:
            self._pending = False  # first: a change while the weights are read marks the guard again
            self.params = tuple(module.parameters())
            if self.baked:
                self._note_ids(module)
                if self._stale is None:
                    stamp = weights_stamp(module)
                    if stamp != self.stamp:
                        self.adopt_weights(stamp)
            self.alert = self._stale is not None or self._pending

    def adopt_weights(self, stamp: Stamp | None = None) -> str | None:
        """Refit every winner that baked the weights in with the module's weights as they are now
        and check it against eager; the reason it could not (the module then runs eager), or None."""
        module = self._module()
        if module is None or not self.baked:
            return None
        why = self._refit(module)
        if why is None:
            self.stamp = stamp if stamp is not None else weights_stamp(module)
            return None
        self.stale = (
            f"its weights changed since it was tuned (load_state_dict, .to(), a new Parameter, an optimizer "
            f"step or an in-place update) and "
            f"{', '.join(self.baked)} baked the old ones in ({why}); run ait.tune again to tune the new weights"
        )
        return why

    def _refit(self, module: torch.nn.Module) -> str | None:
        from ..validation import validate  # the refitted payload must still be eager's answer

        if not self.refittable or self.reference is None:
            return "it cannot load new weights"
        weights = module.state_dict()
        mismatch = layout_mismatch(weights, self.built_with)
        if mismatch is not None:
            return f"{mismatch}; nothing was refitted"
        start = time.perf_counter()
        for graph, backend in self.refittable:
            try:
                if not backend.refit(weights):
                    return f"{backend.name} cannot load new weights into its payload"
            except Exception as exc:
                return f"loading them into {backend.name} raised {type(exc).__name__}: {exc}"
            cases = [graph.example(which) for which in (("min", "opt", "max") if graph.dims else ("opt",))]
            with torch.no_grad():
                result = validate(backend, self.reference, cases, graph)
            if not result.passed:
                return f"{backend.name} refitted with them differs from eager: {result.reason}"
        logger.info(
            "refitted %s with the new weights in %.2f s and checked against eager",
            ", ".join(self.baked),
            time.perf_counter() - start,
        )
        return None

    def accept_weights(self) -> None:
        """Take the weights as they are now as the tuned ones (after offloading them on purpose)."""
        module = self._module()
        if module is not None:
            with self._lock:
                self._pending = False
                self.params = tuple(module.parameters())
                if self.baked:
                    self._note_ids(module)
                self.stamp = weights_stamp(module)
                self.alert = self._stale is not None

    def blocked(self, leaves: Sequence[torch.Tensor]) -> tuple[str, type[Exception]] | None:
        """The reason this call must run eager and the error strict mode raises, or None.

        Cheapest first: under ``no_grad`` in eval mode, with nothing changed, one function call and
        a few attribute reads. Weights marked to look at again are looked at only by a call that
        would otherwise run tuned (a training step's calls never pay for it).
        """
        if self.alert and self._stale is not None:
            return self._stale, StaleWeightsError
        if self.hooks.changed:
            acting = self.hooks.acting()
            if acting is not None:
                return acting, HooksChangedError
        if self.training_matters:
            module = self._module()
            if module is not None and module.training:
                return TRAINING, InferenceOnlyError
        if torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.params) or any(t.requires_grad for t in leaves)
        ):
            return NEEDS_GRAD, InferenceOnlyError
        if self.alert:
            return self._looked_again(leaves)
        return None

    def blocks_host_call(self) -> bool:
        """Whether a call made on host arrays (:mod:`aitune.engine.host`) must take the tensor path
        instead, where :meth:`blocked` judges it and says why: the winners went stale or the weights
        are to be looked at again, a hook may act, or training mode matters. Such a call computes no
        gradients, so grad mode does not enter."""
        if self.alert or self.hooks.changed:
            return True
        if self.training_matters:
            module = self._module()
            return module is None or module.training
        return False

    def _looked_again(self, leaves: Sequence[torch.Tensor]) -> tuple[str, type[Exception]] | None:
        """Look at weights marked as changed (refit and check, or stale), then judge the call again:
        a new Parameter may need grad, or the winners may have gone stale."""
        with self._lock:  # one refit for many threads; the others wait and see its outcome
            for _ in range(3):  # a buffer the eager check sets marks it again; the next look finds no change
                if not self._pending:
                    break
                self.check_weights()
        if self._pending:
            return CHANGING, StaleWeightsError
        return self.blocked(leaves)


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

    def __deepcopy__(self, memo: dict[int, Any]) -> RecheckWeights:
        """In a deep copy of the owner, the copied hook tells the copied owner; a copy of the module
        alone has no owner to tell."""
        owner = self._owner() if self._owner is not None else None
        copied = memo.get(id(owner)) if owner is not None else None
        new = RecheckWeights(copied) if copied is not None else RecheckWeights.__new__(RecheckWeights)
        if copied is None:
            new._owner = None
        return new


# -- what changes the weights without a call aitune watches ----------------------------------------

_WATCHED: weakref.WeakSet[Guard] = weakref.WeakSet()
"""Guards whose winners baked the weights in, held weakly: the global hooks mark them."""
_HOOKS: list[Any] = []
_HOOKS_LOCK = threading.Lock()


def _watch(guard: Guard) -> None:
    """Have torch's global hooks mark ``guard`` when its weights change without a call it watches.

    The hooks are registered once per process, when the first guard asks: a new Parameter, buffer
    or submodule set on any module (``register_module_*_registration_hook``) and any optimizer's
    step (``register_optimizer_step_post_hook``). Each only compares ids and sets two flags.
    """
    with _HOOKS_LOCK:
        if not _HOOKS:
            from torch.nn.modules import module as nn_module
            from torch.optim import optimizer

            _HOOKS.extend(
                [
                    nn_module.register_module_parameter_registration_hook(_registered),
                    nn_module.register_module_buffer_registration_hook(_registered),
                    nn_module.register_module_module_registration_hook(_registered),
                    optimizer.register_optimizer_step_post_hook(_stepped),
                ]
            )
        _WATCHED.add(guard)


def _registered(module: torch.nn.Module, name: str, value: object) -> None:
    """A Parameter, buffer or submodule is being set on ``module`` (it is stored after this returns):
    the guards watching ``module`` look at their weights before their next tuned call."""
    if not _WATCHED:
        return
    key = id(module)
    for guard in list(_WATCHED):
        if key in guard.module_ids:
            guard.recheck()


def _stepped(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    """An optimizer stepped: the guards holding any of its tensors look at their weights again."""
    if not _WATCHED:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for guard in list(_WATCHED):
        if not guard.weight_ids.isdisjoint(stepped):
            guard.recheck()
