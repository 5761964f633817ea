"""What aitune reads from the process environment below the settings objects: one boolean parser for
every ``AITUNE_*`` switch, and the user's folders with their fallbacks when there is no home.

One parser, so ``AITUNE_OWN_KEY=disabled`` cannot mean "on" to one module and "off" to another: a
spelling outside the two lists is refused with the ones that work.

A container's arbitrary user id often has no ``HOME`` and no passwd entry (``Path.home()`` raises),
and ``HOME=""`` would put folders at the file system's root. There aitune has no config folder (so
no own signing key) and keeps its cache in a private folder under the temporary folder; it warns once.
"""

from __future__ import annotations

import functools
import os
import tempfile
import warnings
from pathlib import Path

from .errors import ConfigError

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def parse_bool(variable: str, raw: str) -> bool:
    """The switch ``variable`` set to ``raw``: one of :data:`TRUE` or :data:`FALSE` (any case), else
    a :class:`ConfigError` (a ``ValueError``) naming the spellings that work."""
    word = raw.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise ConfigError(
        f"{variable}={raw!r} is not a switch aitune understands; set it to one of {', '.join(TRUE)} (on) or "
        f"{', '.join(FALSE)} (off)"
    )


SWITCHES = {
    "AITUNE_OWN_KEY": True,
    "AITUNE_BUILD_CACHE": True,
    "AITUNE_STRICT_PLUGINS": False,
    "AITUNE_JIT": False,
}
"""The switches read outside a settings object, each with its default; the settings objects parse
their own (``AITUNE_JIT_DEFERRED`` ...) with :func:`parse_bool` when they are made."""


def switch(variable: str, default: bool) -> bool:
    """Whether the switch ``variable`` is on; ``default`` when it is unset or empty."""
    raw = os.environ.get(variable, "")
    return default if not raw.strip() else parse_bool(variable, raw)


def check_switches() -> None:
    """Read every switch of :data:`SWITCHES` once, so a misspelt one fails where ``ait.tune``,
    ``ait.save`` or ``ait.load`` starts, before anything changes, not deep inside a build that
    would turn it into a failed candidate."""
    for variable, default in SWITCHES.items():
        switch(variable, default)


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
