"""Settings objects, and ``ait.config``: the process-wide defaults of ``ait.tune``.

A settings object is an attrs instance of a :class:`Settings` subclass whose fields are the
settings. Every assignment runs the field's converter and validators, so a bad value fails
where it is made, and a misspelt name is refused with the list of names. A field may name the
environment variable it is read from (an :class:`aitune.envvars.Variable`, :func:`from_env`);
``Settings._read_environment``, run when the object is made and by :meth:`Settings.reset`, reads
them through it. Two objects exist: :data:`settings` here, public as ``ait.config`` and
``aitune.torch.config``, and JIT tuning's
:data:`aitune.engine.jit.settings.settings`, public as ``aitune.torch.jit.config``. The engine
reads them at each use, so a change affects what is tuned after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import attrs

from ..envvars import Variable

_CONVERT_AND_CHECK = attrs.setters.pipe(attrs.setters.convert, attrs.setters.validate)


class Settings:
    """Base of a settings class; subclasses are ``@attrs.define(eq=False, on_setattr=attrs.setters.NO_OP)``.

    ``on_setattr`` is off in the subclass because this ``__setattr__`` runs the same attrs setters
    (the field's converter, then its validators) and also refuses names that are not fields,
    which attrs' own ``__setattr__`` would let through to a bare ``AttributeError``.
    """

    __slots__ = ()
    __attrs_attrs__: ClassVar[tuple[attrs.Attribute[Any], ...]]
    public_name: ClassVar[str]
    """The name users set it through (``ait.config``), used in error messages."""

    def __attrs_post_init__(self) -> None:
        self._read_environment()

    def __setattr__(self, name: str, value: Any) -> None:
        field = attrs.fields_dict(type(self)).get(name)
        if field is None:
            names = sorted(attrs.fields_dict(type(self)))
            raise AttributeError(f"{self.public_name} has no setting {name!r}; the settings are {names}")
        object.__setattr__(self, name, _CONVERT_AND_CHECK(self, field, value))

    def reset(self) -> None:
        """Back to the defaults, then the environment variables."""
        for field in attrs.fields(type(self)):
            setattr(self, field.name, field.default)
        self._read_environment()

    @contextlib.contextmanager
    def patch(self, **settings: Any) -> Iterator[None]:
        """Change settings inside a ``with`` block (tests, one-off runs); each is checked as when set."""
        known = attrs.fields_dict(type(self))
        before = {name: getattr(self, name) for name in settings if name in known}
        try:
            for name, value in settings.items():
                setattr(self, name, value)
            yield
        finally:
            for name, value in before.items():
                setattr(self, name, value)

    def _read_environment(self) -> None:
        for field in attrs.fields(type(self)):
            if "env" not in field.metadata:
                continue
            variable: Variable[Any] = field.metadata["env"]
            raw = variable.text()
            if raw is None:
                continue
            value = variable.parse(variable.name, raw)  # a ValueError here names the variable already
            try:
                setattr(self, field.name, value)
            except ValueError as exc:
                raise ValueError(f"{variable.name}={raw!r}: {exc}") from None


def from_env(name: str, parse: Callable[[str, str], Any]) -> dict[str, Any]:
    """A field's metadata saying which environment variable sets it, and how its text is read
    (a parser of :mod:`aitune.envvars`); unset or empty, the field keeps its value."""
    return {"env": Variable(name, parse)}


# Converters and validators shared by the settings classes; messages name the setting as users write it.


def _fail(instance: Settings, attribute: attrs.Attribute[Any], expected: str, value: Any) -> None:
    raise ValueError(f"{instance.public_name}.{attribute.name} must be {expected}, got {value!r}")


def int_at_least(low: int) -> Callable[[Settings, attrs.Attribute[Any], Any], None]:
    def check(instance: Settings, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            _fail(instance, attribute, f"an int >= {low}", value)

    return check


def boolean(instance: Settings, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        _fail(instance, attribute, "True or False", value)


def boolean_or_none(instance: Settings, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        _fail(instance, attribute, "True, False or None", value)


def one_of(*choices: str) -> Callable[[Settings, attrs.Attribute[Any], Any], None]:
    def check(instance: Settings, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            _fail(instance, attribute, f"one of {', '.join(choices)}", value)

    return check


def share(instance: Settings, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        _fail(instance, attribute, "a number in (0, 1]", value)


def as_float(value: Any) -> Any:
    """An int becomes a float; anything else is left for the validator to judge."""
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def as_names(value: Any) -> Any:
    """One name becomes a tuple of one, a list a tuple; anything else is left for the validator."""
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list) else value


def names(*, optional: bool) -> Callable[[Settings, attrs.Attribute[Any], Any], None]:
    def check(instance: Settings, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
            _fail(instance, attribute, "a sequence of non-empty strings" + (" or None" if optional else ""), value)

    return check


def _strategy_factory(instance: Settings, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not callable(value):
        _fail(instance, attribute, "a callable that makes a TuneStrategy, or None", value)


@attrs.define(eq=False, on_setattr=attrs.setters.NO_OP)
class TuneSettings(Settings):
    """The process-wide defaults of ``ait.tune``; an argument given to ``ait.tune`` or ``ait.Module`` wins."""

    public_name: ClassVar[str] = "ait.config"

    max_samples: int = attrs.field(default=8, validator=int_at_least(1))
    """Samples kept per graph while recording (distinct shapes are preferred once it is full)."""
    fail_fast: bool = attrs.field(default=False, validator=boolean)
    """Raise the first error of any module instead of leaving that module eager and going on."""
    freeze: bool = attrs.field(default=True, validator=boolean)
    """After tuning (and loading), make the parameters of tuned modules inference-only, so a plain
    ``model(x)`` runs the winner instead of eager (parameters from ``from_pretrained`` require grad)."""
    show_progress: bool | None = attrs.field(default=None, validator=boolean_or_none)
    """Live progress lines; None shows them when stderr is a terminal."""
    default_strategy: Callable[[], Any] | None = attrs.field(default=None, validator=_strategy_factory)
    """Makes the strategy of a module that names none; None means ``MaxThroughputStrategy()`` over
    every default backend available on the tune device."""


settings = TuneSettings()
"""``ait.config``, the one ``TuneSettings`` the engine reads."""
