"""``generate()`` with transformers' default cache, tuned: switching the model to a static cache.

transformers' default ``DynamicCache`` grows by concatenation, a new tensor every step, so no
compiled graph can hold it and the decode step runs eager. Its static cache is preallocated and
updated in place, which a backend can run (see :mod:`aitune.state`). A model declares that its
forward compiles as one graph with a static cache by ``_can_compile_fullgraph = True`` (Llama,
Mistral, Qwen2, GPT-2, Gemma, Whisper, T5 in transformers 5); ``generate()`` makes a static cache
when ``generation_config.cache_implementation == "static"``.

So before recording, ``ait.tune`` sets ``cache_implementation = "static"`` on every such model
that holds a wrapped module and whose user chose no cache (``None``), so the recorded calls already
use it. After recording, a model none of whose wrapped modules saw a static cache (its pipeline
never called ``generate()``) is put back as it was; so is every model when the tune fails or is a
dry run. ``ait.tune(..., static_cache=False)`` leaves generation configs alone. ``ait.load`` does
the same for a model whose loaded decode step runs on a static cache. Nothing from transformers is
imported: models are recognised by their attributes.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from .module import named_top_modules, wrapped_modules

logger = logging.getLogger("aitune")

STATIC = "static"


def why_not_static(model: Any) -> str | None:
    """Why ``generate()`` of ``model`` is not switched to a static cache, or None when it can be."""
    config = getattr(model, "generation_config", None)
    if config is None or not callable(getattr(model, "generate", None)):
        return "it has no generate()"
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"{type(model).__name__} does not declare that it compiles with a static cache (_can_compile_fullgraph)"
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if callable(supports) and not supports():
        return f"{type(model).__name__} manages its own cache"
    if getattr(config, "use_cache", True) is False:
        return "its generation config has use_cache=False"
    if getattr(config, "cache_implementation", None) is not None:
        return f"its generation config already names a cache ({config.cache_implementation!r})"
    return None


def candidates(obj: Any) -> list[Any]:
    """The modules ``obj`` holds (itself, a pipeline's attributes) or, for a function, the ones its
    code names (closure and globals; a bound method's object), that hold a wrapped module."""
    found = [m for _, m in named_top_modules(obj)]
    for value in _named_by(obj):
        found += [m for _, m in named_top_modules(value)]
    out: list[Any] = []
    for module in found:
        for sub in module.modules():
            generates = getattr(sub, "generation_config", None) is not None and callable(getattr(sub, "generate", None))
            if generates and sub not in out and wrapped_modules(sub):
                out.append(sub)
    return out


def _named_by(obj: Any) -> list[Any]:
    """What a function's code refers to: ``lambda ids: model.generate(ids)`` names ``model``."""
    owner = getattr(obj, "__self__", None)
    if owner is not None:
        return [owner]
    if not inspect.isfunction(obj):
        return []
    try:
        names = inspect.getclosurevars(obj)
    except (TypeError, ValueError):
        return []
    return [*names.nonlocals.values(), *names.globals.values()]


class StaticCacheSwitch:
    """The generation configs ``ait.tune`` switched to a static cache, to keep or put back."""

    def __init__(self, models: list[Any]) -> None:
        self.models = models

    @classmethod
    def apply(cls, obj: Callable[..., Any] | Any) -> StaticCacheSwitch:
        """Switch every model of :func:`candidates` that :func:`why_not_static` allows."""
        switched = []
        for model in candidates(obj):
            reason = why_not_static(model)
            if reason is None:
                model.generation_config.cache_implementation = STATIC
                switched.append(model)
            else:
                logger.debug("%s: generate() keeps its cache: %s", type(model).__name__, reason)
        return cls(switched)

    def settle(self, used: bool, by: str = "ait.tune") -> list[str]:
        """Keep the switch where a static cache was recorded (``used``), else put it back; the
        report's lines for what is kept (``by`` names the call whose ``static_cache=False`` opts out)."""
        if not used:
            self.restore()
            return []
        notes = []
        for model in self.models:
            note = (
                f"{type(model).__name__}.generation_config.cache_implementation set to {STATIC!r} (it was None) so "
                "generate() uses a static KV cache, whose decode step a backend can run; "
                f"{by}(..., static_cache=False) keeps the default cache"
            )
            logger.info("%s", note)
            notes.append(note)
        return notes

    def restore(self) -> None:
        for model in self.models:
            if model.generation_config.cache_implementation == STATIC:
                model.generation_config.cache_implementation = None
        self.models = []
