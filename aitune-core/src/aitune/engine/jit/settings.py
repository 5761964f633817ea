"""JIT tuning's settings, public as ``aitune.torch.jit.config``: :data:`settings`, a :class:`JITSettings`.

    from aitune.torch.jit import config as jit_config
    jit_config.min_samples = 3

Every setting but ``strategy`` can also come from its environment variable
(``AITUNE_JIT_MIN_SAMPLES=3``), because with ``AITUNE_JIT=1`` and no code change the environment
is the only place to say anything; it is read when the settings are made (at import) and at
``reset()``. Values are read when they are used, so changing one mid-run affects the modules
tuned after it. The mechanism is :class:`aitune.engine.settings.Settings`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from ...envvars import parse_bool, parse_float, parse_int, parse_names, parse_word
from ..settings import Settings, as_float, as_names, boolean, from_env, int_at_least, names, one_of, share

MODES = ("background", "inline")


def _strategy(instance: Settings, attribute: attrs.Attribute[Any], value: Any) -> None:
    from ..strategies import TuneStrategy

    if value is not None and not isinstance(value, TuneStrategy):
        raise ValueError(f"{instance.public_name}.{attribute.name} must be a TuneStrategy or None, got {value!r}")


@attrs.define(eq=False, on_setattr=attrs.setters.NO_OP)
class JITSettings(Settings):
    """What JIT tuning tunes, when, and how."""

    public_name: ClassVar[str] = "aitune.torch.jit.config"

    strategy: Any = attrs.field(default=None, validator=_strategy)
    """A ``TuneStrategy`` used for every module, or None: ``FirstWinsStrategy`` over ``backends``
    (or, when that is None too, over every default backend available on the module's device, with
    backends that compile anything, like ``torch_inductor_jit``, last)."""
    backends: tuple[str, ...] | None = attrs.field(
        default=None,
        converter=as_names,
        validator=names(optional=True),
        metadata=from_env("AITUNE_JIT_BACKENDS", parse_names),
    )
    """Registered backend names, tried in this order by the default strategy."""
    min_samples: int = attrs.field(
        default=5, validator=int_at_least(1), metadata=from_env("AITUNE_JIT_MIN_SAMPLES", parse_int)
    )
    """Calls of a module recorded before it is tuned."""
    max_depth: int = attrs.field(
        default=2, validator=int_at_least(0), metadata=from_env("AITUNE_JIT_MAX_DEPTH", parse_int)
    )
    """How far below a top-level module tuning may descend when a module stays eager (0: top level only)."""
    min_parameters: int = attrs.field(
        default=100_000, validator=int_at_least(0), metadata=from_env("AITUNE_JIT_MIN_PARAMETERS", parse_int)
    )
    """Modules with fewer parameters (their children's included) are never tuned."""
    exclude: tuple[str, ...] = attrs.field(
        default=(),
        converter=as_names,
        validator=names(optional=False),
        metadata=from_env("AITUNE_JIT_EXCLUDE", parse_names),
    )
    """Prefixes of class names (``Dropout``, ``mypkg.blocks.``) or module paths (``Model.head``) to leave eager."""
    detect_graph_breaks: bool = attrs.field(
        default=True, validator=boolean, metadata=from_env("AITUNE_JIT_DETECT_GRAPH_BREAKS", parse_bool)
    )
    """Trace each module with TorchDynamo before building; a module with graph breaks stays eager
    and its children are tried instead."""
    deferred: bool = attrs.field(default=False, validator=boolean, metadata=from_env("AITUNE_JIT_DEFERRED", parse_bool))
    """Record until ``aitune.torch.jit.tune.deferred()`` is called, then tune at the next forward,
    for pipelines that call modules a varying number of times per step."""
    remember: bool = attrs.field(default=True, validator=boolean, metadata=from_env("AITUNE_JIT_REMEMBER", parse_bool))
    """Store each decision in the cache dir and reuse it in later runs (``AITUNE_JIT_REMEMBER=0`` turns it off)."""
    mode: str = attrs.field(
        default="background", validator=one_of(*MODES), metadata=from_env("AITUNE_JIT_MODE", parse_word)
    )
    """``background``: a module is tuned on a tuner thread while its calls keep running eager, and
    its winner is installed between two calls; ``inline``: tuned inside the call that reached
    ``min_samples``, which waits (for batch jobs that prefer to wait)."""
    preload: bool = attrs.field(default=True, validator=boolean, metadata=from_env("AITUNE_JIT_PRELOAD", parse_bool))
    """In background mode, import what tuning will need (core's list and each default backend's
    ``warm_imports``) when JIT tuning is switched on, before the program serves: a module first
    imported by the tuner thread stalls the program's calls. Costs about a second, once."""
    max_tuning_share: float = attrs.field(
        default=0.5,
        converter=as_float,
        validator=share,
        metadata=from_env("AITUNE_JIT_MAX_TUNING_SHARE", parse_float),
    )
    """The share of wall time the background tuner may spend timing candidates (0.5: one core of two)."""


settings = JITSettings()
"""``aitune.torch.jit.config``, the one ``JITSettings`` the JIT reads."""
