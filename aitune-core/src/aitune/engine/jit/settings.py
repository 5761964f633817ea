"""Settings of JIT tuning: plain attributes of this module, checked when set.

    import aitune.torch.jit.config as jit_config
    jit_config.min_samples = 3

Every setting can also come from the environment (``AITUNE_JIT_MIN_SAMPLES=3``), because with
``AITUNE_JIT=1`` and no code change the environment is the only place to say anything. Values
are read when they are used, so changing one mid-run affects the modules tuned after it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

strategy: Any = None
"""A ``TuneStrategy`` used for every module, or None: ``FirstWinsStrategy`` over ``backends``
(or, when that is None too, over every default backend available on the module's device, with
backends that compile anything, like ``torch_inductor_jit``, last)."""
backends: tuple[str, ...] | None = None
"""Registered backend names, tried in this order by the default strategy (``AITUNE_JIT_BACKENDS``)."""
min_samples: int = 5
"""Calls of a module recorded before it is tuned (``AITUNE_JIT_MIN_SAMPLES``)."""
max_depth: int = 2
"""How far below a top-level module tuning may descend when a module stays eager (0: top level only)."""
min_parameters: int = 100_000
"""Modules with fewer parameters (their children's included) are never tuned."""
exclude: tuple[str, ...] = ()
"""Prefixes of class names (``Dropout``, ``mypkg.blocks.``) or module paths (``Model.head``) to leave eager."""
detect_graph_breaks: bool = True
"""Trace each module with TorchDynamo before building; a module with graph breaks stays eager
and its children are tried instead."""
deferred: bool = False
"""Record until ``aitune.torch.jit.tune.deferred()`` is called, then tune at the next forward,
for pipelines that call modules a varying number of times per step."""
remember: bool = True
"""Store each decision in the cache dir and reuse it in later runs (``AITUNE_JIT_REMEMBER=0`` turns it off)."""
mode: str = "background"
"""``background``: a module is tuned on a tuner thread while its calls keep running eager, and
its winner is installed between two calls; ``inline``: tuned inside the call that reached
``min_samples``, which waits (``AITUNE_JIT_MODE=inline``, for batch jobs that prefer to wait)."""
max_tuning_share: float = 0.5
"""The share of wall time the background tuner may spend timing candidates (0.5: one core of two)."""


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"aitune.torch.jit.config.{name} must be an int >= 0, got {value!r}")
    return value


def _positive(name: str, value: Any) -> int:
    if _int(name, value) < 1:
        raise ValueError(f"aitune.torch.jit.config.{name} must be >= 1, got {value!r}")
    return int(value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"aitune.torch.jit.config.{name} must be True or False, got {value!r}")
    return value


def _names(name: str, value: Any) -> tuple[str, ...] | None:
    if value is None and name == "backends":
        return None
    if isinstance(value, str):
        value = [value]
    items = tuple(value) if value is not None else ()
    if not all(isinstance(v, str) and v for v in items):
        raise ValueError(f"aitune.torch.jit.config.{name} must be a sequence of non-empty strings, got {value!r}")
    return items


MODES = ("background", "inline")


def _mode(name: str, value: Any) -> str:
    if value not in MODES:
        raise ValueError(f"aitune.torch.jit.config.mode must be one of {', '.join(MODES)}, got {value!r}")
    return str(value)


def _share(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"aitune.torch.jit.config.{name} must be a number in (0, 1], got {value!r}")
    return float(value)


def _strategy(name: str, value: Any) -> Any:
    from ..strategies import TuneStrategy

    if value is not None and not isinstance(value, TuneStrategy):
        raise ValueError(f"aitune.torch.jit.config.strategy must be a TuneStrategy or None, got {value!r}")
    return value


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "strategy": _strategy,
    "backends": _names,
    "min_samples": _positive,
    "max_depth": _int,
    "min_parameters": _int,
    "exclude": _names,
    "detect_graph_breaks": _bool,
    "deferred": _bool,
    "remember": _bool,
    "mode": _mode,
    "max_tuning_share": _share,
}
_DEFAULTS = {name: globals()[name] for name in _CHECKS}


def _from_env(name: str, raw: str) -> Any:
    raw = raw.strip()
    default = _DEFAULTS[name]
    if name in ("backends", "exclude"):
        return tuple(item.strip() for item in raw.split(",") if item.strip())
    if name == "mode":
        return raw.lower()
    if name == "max_tuning_share":
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"AITUNE_JIT_MAX_TUNING_SHARE={raw!r} is not a number") from None
    if isinstance(default, bool):
        if raw.lower() in {"1", "true", "yes", "on"}:
            return True
        if raw.lower() in {"0", "false", "no", "off"}:
            return False
        raise ValueError(f"AITUNE_JIT_{name.upper()}={raw!r} is not a boolean; use 1 or 0")
    try:
        return int(raw.replace("_", ""))
    except ValueError:
        raise ValueError(f"AITUNE_JIT_{name.upper()}={raw!r} is not an integer") from None


def reset() -> None:
    """Back to the defaults, then the ``AITUNE_JIT_*`` environment variables."""
    module = sys.modules[__name__]
    for name, default in _DEFAULTS.items():
        setattr(module, name, default)
    for name in _DEFAULTS:
        raw = os.environ.get(f"AITUNE_JIT_{name.upper()}")
        if raw is not None and name != "strategy":
            setattr(module, name, _from_env(name, raw))


@contextlib.contextmanager
def patch(**settings: Any) -> Iterator[None]:
    """Change settings inside a ``with`` block (tests, one-off runs)."""
    module = sys.modules[__name__]
    before = {name: getattr(module, name) for name in settings}
    try:
        for name, value in settings.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)


class _ConfigModule(types.ModuleType):
    """Checks each setting as it is assigned, so a typo or a bad value fails where it is made."""

    def __setattr__(self, name: str, value: Any) -> None:
        check = _CHECKS.get(name)
        if name.startswith("_"):
            super().__setattr__(name, value)
            return
        if check is None:
            raise AttributeError(f"aitune.torch.jit.config has no setting {name!r}; the settings are {sorted(_CHECKS)}")
        super().__setattr__(name, check(name, value))


sys.modules[__name__].__class__ = _ConfigModule
reset()
