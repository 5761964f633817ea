"""Configuration of the torchao backend: plain JSON-able values, so a tuned model saves with it.

Importing this module imports no torchao. A torchao config object given by the user is turned
into torchao's own JSON form here only when that form reads back to an equal object; otherwise
it is kept as is, runs, and refuses to be saved.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import attrs
import torch

from aitune.backend import BackendConfig, Tolerance
from aitune.errors import ConfigError

PRESETS = ("int8wo", "int8dq", "int4wo", "fp8wo", "fp8dq")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _names(value: Any) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(n, str) for n in names):
        raise ConfigError(f"filter_fn: patterns and type names must be strings, got {value!r}")
    return names


@attrs.frozen(kw_only=True)
class ModuleFilter:
    """Which submodules get quantized, by name pattern and class name: a filter that can be saved.

    A submodule is quantized when its class name is in ``types`` (exactly: like torchao's default
    filter, ``"Linear"`` does not take attention's ``NonDynamicallyQuantizableLinear``), its dotted
    name matches a pattern in ``include`` and none in ``exclude`` (``fnmatch`` patterns such as
    ``"encoder.*"`` or ``"*.linear2"``).
    """

    include: tuple[str, ...] = attrs.field(default=("*",), converter=_names)
    exclude: tuple[str, ...] = attrs.field(default=(), converter=_names)
    types: tuple[str, ...] = attrs.field(default=("Linear",), converter=_names)

    def __call__(self, module: torch.nn.Module, fqn: str) -> bool:
        return (
            type(module).__name__ in self.types
            and any(fnmatch.fnmatchcase(fqn, p) for p in self.include)
            and not any(fnmatch.fnmatchcase(fqn, p) for p in self.exclude)
        )


def _quantization(value: Any) -> Any:
    """A preset name, torchao's JSON form of a config, or (unsaveable) the config object itself."""
    if isinstance(value, str):
        if value not in PRESETS:
            raise ConfigError(f"quantization: unknown preset {value!r}; choose one of {', '.join(PRESETS)}")
        return value
    if isinstance(value, dict):
        if "_type" not in value or "_data" not in value:
            raise ConfigError(
                "quantization: a dict must be torchao's JSON form of a config (keys '_type', '_data'), "
                "as torchao.core.config.config_to_dict writes it"
            )
        return value
    if type(value).__module__.startswith("torchao") or _is_ao_config(value):
        return _to_json_form(value)
    raise ConfigError(
        f"quantization: expected a preset name ({', '.join(PRESETS)}) or a torchao AOBaseConfig, "
        f"got {type(value).__name__}"
    )


def _is_ao_config(value: Any) -> bool:
    return any(cls.__name__ == "AOBaseConfig" for cls in type(value).__mro__)


def _to_json_form(config: Any) -> Any:
    # torchao is already imported here: the user built the object with it.
    from torchao.core.config import AOBaseConfig, config_from_dict, config_to_dict

    if not isinstance(config, AOBaseConfig):
        raise ConfigError(f"quantization: {type(config).__name__} is not a torchao AOBaseConfig")
    try:
        data = config_to_dict(config)
        if config_from_dict(data) == config:
            return data
    except Exception:
        pass
    return config


def _filter(value: Any) -> Any:
    if value is None or isinstance(value, ModuleFilter):
        return value
    if isinstance(value, dict):
        return ModuleFilter(**value)
    if callable(value):
        return value
    raise ConfigError(f"filter_fn: expected a ModuleFilter, a dict of its fields or a callable, got {value!r}")


@attrs.frozen(kw_only=True)
class TorchAOBackendConfig(BackendConfig):
    """Settings of TorchAOBackend.

    ``quantization`` is a preset name (see README), or a torchao ``AOBaseConfig``; the latter is
    stored in torchao's JSON form (``config_to_dict``) so it saves, or kept as the object when it
    has no faithful JSON form (then the tuned model runs but cannot be saved). ``filter_fn``
    chooses the submodules: None for torchao's default (every ``nn.Linear``), a
    :class:`ModuleFilter`, or any ``callable(module, fqn) -> bool`` (not saveable).
    ``tolerance`` replaces the preset's accuracy bound for floating outputs.
    """

    quantization: Any = attrs.field(default="int8dq", converter=_quantization, hash=False)
    filter_fn: Any = attrs.field(default=None, converter=_filter, hash=False)
    compile: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    compile_mode: str | None = attrs.field(default=None, validator=attrs.validators.in_(COMPILE_MODES))
    tolerance: Tolerance | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(Tolerance))
    )

    @property
    def quantization_name(self) -> str:
        """The preset name or the torchao config class name, for messages and reports."""
        q = self.quantization
        if isinstance(q, str):
            return q
        return str(q["_type"]) if isinstance(q, dict) else type(q).__name__

    def unsaveable_reason(self) -> str | None:
        """Why a model tuned with this config cannot be written to an artifact, or None."""
        if self.filter_fn is not None and not isinstance(self.filter_fn, ModuleFilter):
            return (
                "filter_fn is a Python callable, which cannot be saved without pickle; describe it with "
                "ModuleFilter(include=[...], exclude=[...], types=[...]) instead"
            )
        if not isinstance(self.quantization, (str, dict)):
            return (
                f"the torchao config {type(self.quantization).__name__} has no JSON form that reads back "
                "equal (torchao.core.config.config_to_dict / config_from_dict), and aitune never pickles; "
                "use a preset or a torchao config class that torchao can serialize"
            )
        return None
