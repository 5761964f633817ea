"""The one reader of aitune's environment: every ``AITUNE_*`` variable is declared and read here.

Each variable is a :class:`Variable`: its name, the parser its text goes through, and the text it
stands for when unset or empty. The modules a variable configures call its :meth:`Variable.get`
each time they need it (so a test or a program that sets it later is seen), never ``os.environ``:
``aitune-core/tests/test_envvars.py`` fails on an ``AITUNE_`` read anywhere else, and checks that
docs/settings.md lists every variable declared here, in JIT tuning's settings
(:mod:`aitune.engine.jit.settings`, through :func:`aitune.engine.settings.from_env`) and in the
Ray executor, with its default. The one exception is the gate at interpreter start
(``aitune_jit.pth`` and ``_aitune_jit_hook``), which checks that ``AITUNE_JIT`` is set before
importing aitune at all; the hook then reads it here.

One boolean parser, :func:`parse_bool`, so ``AITUNE_OWN_KEY=disabled`` cannot mean "on" to one
module and "off" to another; every parser refuses a text with a :class:`ConfigError` (a
``ValueError``) that names the variable and the spellings that work.

A container's arbitrary user id often has no ``HOME`` and no passwd entry (``Path.home()`` raises),
and ``HOME=""`` would put folders at the file system's root. There aitune has no config folder (so
no own signing key) and keeps its cache in a private folder under the temporary folder; it warns once.
"""

from __future__ import annotations

import functools
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar, cast, overload

from .errors import ConfigError

T = TypeVar("T")
U = TypeVar("U")

# -- parsers: (variable, its stripped text) -> value, or a ConfigError naming both ----------------

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def parse_bool(variable: str, raw: str) -> bool:
    """The switch ``variable`` set to ``raw``: one of :data:`TRUE` or :data:`FALSE` (any case), else
    a :class:`ConfigError` naming the spellings that work."""
    word = raw.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise ConfigError(
        f"{variable}={raw!r} is not a switch aitune understands; set it to one of {', '.join(TRUE)} (on) or "
        f"{', '.join(FALSE)} (off)"
    )


def parse_int(variable: str, raw: str) -> int:
    """An integer (``1_000`` too); its range is checked by whoever uses it."""
    try:
        return int(raw.replace("_", ""))
    except ValueError:
        raise ConfigError(f"{variable}={raw!r} is not an integer") from None


def parse_float(variable: str, raw: str) -> float:
    """A number; its range is checked by whoever uses it."""
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{variable}={raw!r} is not a number") from None


def parse_names(variable: str, raw: str) -> tuple[str, ...]:
    """A comma-separated list: ``onnxruntime, torch_inductor_jit``."""
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def parse_word(variable: str, raw: str) -> str:
    """A name, in lower case (``Ray`` is ``ray``)."""
    return raw.lower()


def parse_text(variable: str, raw: str) -> str:
    """The text as it is (a name whose case matters)."""
    return raw


def parse_path(variable: str, raw: str) -> Path:
    return Path(raw)


def choice(*words: str) -> Callable[[str, str], str]:
    """One of ``words`` (any case)."""

    def parse(variable: str, raw: str) -> str:
        word = raw.lower()
        if word not in words:
            raise ConfigError(
                f"{variable}={raw!r} is not one of {', '.join(words)}; set one of them, or unset it for the default"
            )
        return word

    return parse


def whole(at_least: int, what: str = "") -> Callable[[str, str], int]:
    """A whole number ``>= at_least``; ``what`` says what it counts, for the message."""

    def parse(variable: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = at_least - 1
        if value < at_least:
            raise ConfigError(f"{variable}={raw!r} is not a whole number >= {at_least}{_saying(what)}")
        return value

    return parse


def number(*, at_least: float | None = None, above: float | None = None, what: str = "") -> Callable[[str, str], float]:
    """A number ``>= at_least`` or ``> above`` (give one); ``what`` says what it measures, for the message."""
    if (at_least is None) == (above is None):
        raise TypeError("number() takes one bound: at_least or above")
    bound = f">= {at_least:g}" if at_least is not None else f"> {above:g}"

    def parse(variable: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")  # refused below, as every comparison with it is False
        fits = value >= at_least if at_least is not None else value > cast(float, above)
        if not fits:
            raise ConfigError(f"{variable}={raw!r} must be a number {bound}{_saying(what)}")
        return value

    return parse


def _saying(what: str) -> str:
    return f" ({what}), or unset it for the default" if what else ", or unset it for the default"


# -- a variable ----------------------------------------------------------------------------------


class Variable(Generic[T]):
    """One ``AITUNE_*`` environment variable: its name, how its text is read, and the text it stands
    for when unset or empty (``default``; None: the module that uses it works the default out, and
    :meth:`get` answers None). Read at each :meth:`get`, so a change of the environment is seen."""

    __slots__ = ("default", "name", "parse")

    @overload
    def __init__(self: Variable[U], name: str, parse: Callable[[str, str], U], default: str) -> None: ...

    @overload
    def __init__(self: Variable[U | None], name: str, parse: Callable[[str, str], U], default: None = None) -> None: ...

    def __init__(self, name: str, parse: Callable[[str, str], object], default: str | None = None) -> None:
        if not name.startswith("AITUNE_"):
            raise ValueError(f"{name} is not an aitune variable: their names start with AITUNE_")
        self.name, self.parse, self.default = name, parse, default

    def text(self) -> str | None:
        """What the environment says, stripped; None when the variable is unset or empty."""
        return os.environ.get(self.name, "").strip() or None

    def get(self) -> T:
        """The value: the text parsed, else the default parsed, else None."""
        raw = self.text() or self.default
        return cast(T, None if raw is None else self.parse(self.name, raw))

    def __repr__(self) -> str:
        return f"Variable({self.name!r}, default={self.default!r})"


# -- every variable of aitune-core (JIT tuning's are its settings' fields) ----------------------------
# The default text of each is also docs/settings.md's, and test_envvars.py checks they agree.

CACHE_DIR = Variable("AITUNE_CACHE_DIR", parse_path)
"""aitune's cache folder; unset: ``$XDG_CACHE_HOME/aitune``, else ``~/.cache/aitune`` (:mod:`aitune.cachedir`)."""
CONFIG_DIR = Variable("AITUNE_CONFIG_DIR", parse_path)
"""The own signing key's folder; unset: ``$XDG_CONFIG_HOME/aitune``, else ``~/.config/aitune``
(:mod:`aitune.artifact.ownkey`)."""
OWN_KEY = Variable("AITUNE_OWN_KEY", parse_bool, "1")
"""Sign with, and trust, the user's own key."""
BUILD_CACHE = Variable("AITUNE_BUILD_CACHE", parse_bool, "1")
"""Reuse a build made before (:mod:`aitune.builtin.buildcache`)."""
STRICT_PLUGINS = Variable("AITUNE_STRICT_PLUGINS", parse_bool, "0")
"""A plugin that fails to import raises instead of being skipped with a warning."""
DISABLE_PLUGINS = Variable("AITUNE_DISABLE_PLUGINS", parse_names)
"""Entry points or distributions not to load; unset: none."""
LOAD_PLUGINS = Variable("AITUNE_LOAD_PLUGINS", parse_names)
"""The only entry points or distributions to load; unset: all."""
EXECUTOR = Variable("AITUNE_EXECUTOR", parse_word, "local")
"""Where isolated builds run when ``ait.tune`` names no executor."""
ISOLATE = Variable("AITUNE_ISOLATE", choice("native", "all", "none"), "native")
"""Which backends build in a worker process (:mod:`aitune.builds.isolation`)."""
BUILD_WORKERS = Variable(
    "AITUNE_BUILD_WORKERS", whole(0, "how many builds may run beside the tune; 0: one at a time, when asked for")
)
"""Builds the local executor runs beside the tune; unset: the cores the tune's threads leave, at most 2."""
BUILD_TIMEOUT_S = Variable("AITUNE_BUILD_TIMEOUT_S", number(above=0, what="seconds"), "1800")
"""A worker's time limit, in seconds."""
BUILD_MEMORY_MB = Variable("AITUNE_BUILD_MEMORY_MB", number(at_least=0, what="megabytes; 0: no cap"))
"""A worker's address-space cap; unset: three quarters of the machine's memory for a CPU build, none for CUDA."""
DISTRIBUTED = Variable("AITUNE_DISTRIBUTED", choice("auto", "off"), "auto")
"""Whether the ranks of a ``torch.distributed`` job tune together (:mod:`aitune.distributed`)."""
DISTRIBUTED_TIMEOUT_S = Variable("AITUNE_DISTRIBUTED_TIMEOUT_S", number(above=0, what="seconds"), "7200")
"""How long a rank waits for the others."""
RANK_DECISION = Variable("AITUNE_RANK_DECISION", parse_word, "rank0")
"""Who decides for the ranks when ``ait.tune`` does not say (checked by :func:`aitune.distributed.rank_decision`)."""
JIT = Variable("AITUNE_JIT", parse_bool, "0")
"""JIT tuning from the interpreter's start (``_aitune_jit_hook``)."""

SWITCHES = (OWN_KEY, BUILD_CACHE, STRICT_PLUGINS, JIT)
"""The yes/no variables, checked together where a run starts (:func:`check_switches`)."""


def check_switches() -> None:
    """Read every switch of :data:`SWITCHES` once, so a misspelt one fails where ``ait.tune``,
    ``ait.save`` or ``ait.load`` starts, before anything changes, not deep inside a build that
    would turn it into a failed candidate."""
    for variable in SWITCHES:
        variable.get()


# -- the user's folders -------------------------------------------------------------------------------


def home() -> Path | None:
    """The user's home folder, or None when there is none to use (no ``HOME`` and no passwd entry,
    an empty ``HOME``, or one that is not an absolute path)."""
    raw = os.environ.get("HOME")
    if raw is not None:
        return Path(raw) if raw and os.path.isabs(raw) else None
    try:
        return Path.home()
    except (RuntimeError, KeyError, OSError):
        return None


def config_base() -> Path | None:
    """``$XDG_CONFIG_HOME``, else ``~/.config``; None with no home (then nothing is configured)."""
    return _xdg("XDG_CONFIG_HOME", ".config")


def cache_base() -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache``; with no home, a folder of this user's under the
    temporary folder (``aitune-<uid>``, checked like any cache folder), with one warning."""
    return _xdg("XDG_CACHE_HOME", ".cache") or homeless_cache()


def _xdg(variable: str, in_home: str) -> Path | None:
    """The XDG base folder ``variable`` names (an absolute path), else ``~/<in_home>``; None with no
    home, warned once."""
    explicit = os.environ.get(variable)
    if explicit and os.path.isabs(explicit):
        return Path(explicit)
    found = home()
    if found is None:
        _warn_homeless()
        return None
    return found / in_home


def homeless_cache() -> Path:
    """Where the cache goes with no home: ``<temporary folder>/aitune-<uid>``."""
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"aitune-{uid}"


@functools.cache
def _warn_homeless() -> None:
    """Once per process: where aitune's folders went, and how to choose them."""
    warnings.warn(
        "aitune: this process has no home folder (HOME is unset or empty, or the user id has no passwd entry), so "
        f"aitune's cache is {homeless_cache()} (unless AITUNE_CACHE_DIR is set) and no own signing key is made or "
        "trusted (unless AITUNE_CONFIG_DIR is set); set HOME, or those two, to folders of your own",
        RuntimeWarning,
        stacklevel=4,
    )
