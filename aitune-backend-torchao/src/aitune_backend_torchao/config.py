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

from aitune.plugin import BackendConfig, ConfigError, Tolerance

from .presets import PRESETS as _PRESETS

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
    """A preset name, the JSON form of an allow-listed torchao config, or (unsaveable) a config object."""
    if isinstance(value, str):
        if value not in PRESETS:
            raise ConfigError(f"quantization: unknown preset {value!r}; choose one of {', '.join(PRESETS)}")
        return value
    if isinstance(value, dict):
        problems = json_form_problems(value)
        if problems:
            raise ConfigError(f"quantization: {problems[0]}")
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
    """torchao's JSON form of ``config`` when aitune's own reader rebuilds an equal object from it,
    else the object (it runs, and refuses to be saved)."""
    # torchao is already imported here: the user built the object with it.
    from torchao.core.config import AOBaseConfig, config_to_dict

    if not isinstance(config, AOBaseConfig):
        raise ConfigError(f"quantization: {type(config).__name__} is not a torchao AOBaseConfig")
    try:
        data = config_to_dict(config)
        if not json_form_problems(data) and from_json_form(data) == config:
            return data
    except Exception:
        pass
    return config


# -- torchao's JSON form, read by aitune, never by torchao's config_from_dict --------------------------
#
# ``config_from_dict`` looks every ``_type`` up in torchao's namespaces and calls it with the file's
# values, and ``{"_type": "torch.dtype", "_data": X}`` returns any attribute of ``torch``. A config
# read from an artifact is data, so aitune reads the form itself from closed lists: the config
# classes the presets build, the small value classes and enums they hold, dtypes by an allow-listed
# name, and plain numbers and switches. Anything else is refused before torchao is imported.

CONFIG_CLASSES = {name: "torchao.quantization" for name in sorted({p.torchao_class for p in _PRESETS.values()})}
"""The torchao configs a saved ``quantization`` may name: those of the presets (README, "Presets")."""
VALUE_CLASSES = {
    **{name: "torchao.quantization" for name in ("PerAxis", "PerGroup", "PerRow", "PerTensor", "PerToken")},
    "Float8MMConfig": "torchao.quantization",
}
"""Value objects a config's fields may hold (granularities, the float8 matmul switches): numbers and switches only."""
ENUMS = {
    "MappingType": "torchao.quantization",
    "Int4PackingFormat": "torchao.quantization.quantize_.workflows",
    "Int4ChooseQParamsAlgorithm": "torchao.quantization.quantize_.workflows",
    "Float8PackingFormat": "torchao.quantization.quantize_.workflows",
    "KernelPreference": "torchao.quantization.quantize_.common",
}
"""Enums a config's fields may hold, by member name."""
DTYPES = (
    "bfloat16",
    "float16",
    "float32",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "int4",
    "int8",
    "int16",
    "int32",
    "uint4",
    "uint8",
)
"""The dtypes a saved form may name (``{"_type": "torch.dtype", "_data": name}``)."""
_SCALARS = (bool, int, float, type(None))


def json_form_problems(data: Any, where: str = "quantization") -> list[str]:
    """Why ``data`` is not a torchao config form aitune reads, in words; empty when it is.

    Checked with no torchao import: the top is one of :data:`CONFIG_CLASSES`, its fields hold
    numbers, switches, None, lists of them, or one of the value classes, enums and dtypes above.
    """
    if not isinstance(data, dict) or not isinstance(data.get("_type"), str) or not isinstance(data.get("_data"), dict):
        return [
            f"{where}: a dict must be torchao's JSON form of a config ({{'_type': name, '_data': {{...}}}}, as "
            f"torchao.core.config.config_to_dict writes it), got {_short(data)}"
        ]
    if data["_type"] not in CONFIG_CLASSES:
        return [
            f"{where}: {_short(data['_type'])} is not a torchao config aitune reads from a file; it reads "
            f"{', '.join(CONFIG_CLASSES)} (pass any other config as the object, in your own code)"
        ]
    return _object_problems(data, where, top=True)


def _object_problems(data: dict[str, Any], where: str, top: bool = False) -> list[str]:
    extra = set(data) - {"_type", "_data", "_version"}
    if extra or not isinstance(data.get("_version", 1), int) or isinstance(data.get("_version"), bool):
        return [f"{where}: unexpected keys or version in {_short(data)}"]
    problems = []
    for key, value in data["_data"].items():
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
            problems.append(f"{where}: field name {_short(key)} is not a plain name")
        elif top or not isinstance(value, (dict, list)):
            problems += _value_problems(value, f"{where}.{key}")
        else:
            problems.append(f"{where}.{key}: a value object holds numbers and switches only, got {_short(value)}")
    return problems


def _value_problems(value: Any, where: str, in_list: bool = False) -> list[str]:
    if isinstance(value, _SCALARS):
        return []
    if isinstance(value, list) and not in_list:
        return [p for i, v in enumerate(value) for p in _value_problems(v, f"{where}[{i}]", in_list=True)]
    if isinstance(value, dict) and isinstance(value.get("_type"), str):
        kind, inner = value["_type"], value.get("_data")
        if kind == "torch.dtype":
            ok = set(value) == {"_type", "_data"} and inner in DTYPES
            return [] if ok else [f"{where}: the dtype {_short(inner)} is not one of {', '.join(DTYPES)}"]
        if kind in ENUMS:
            ok = set(value) <= {"_type", "_data", "_version"} and isinstance(inner, str) and _member_name(inner)
            return [] if ok else [f"{where}: {_short(value)} is not a member of {kind}"]
        if kind in VALUE_CLASSES and isinstance(inner, dict):
            return _object_problems(value, where)
    return [
        f"{where}: {_short(value)} is not a value aitune reads from a file (numbers, switches, None, dtypes "
        f"and torchao's {', '.join([*VALUE_CLASSES, *ENUMS])})"
    ]


def _member_name(name: str) -> bool:
    return name.isidentifier() and not name.startswith("_")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def from_json_form(data: dict[str, Any]) -> Any:
    """The torchao config ``data`` describes, built by aitune from the closed lists above.

    ``data`` must have passed :func:`json_form_problems`; a class comes from a fixed module and a
    name on the lists, an enum member by name, a dtype by an allow-listed name, and only plain
    values reach a constructor.
    """
    problems = json_form_problems(data)
    if problems:
        raise ConfigError(problems[0])
    cls = _lookup(data["_type"], CONFIG_CLASSES)
    saved, current = data.get("_version", 1), getattr(cls, "version", 1)
    if saved != current:
        raise ConfigError(
            f"quantization: the saved {data['_type']} is version {saved}, the installed torchao's is {current}; "
            "tune again with this torchao"
        )
    return _build(cls, data["_data"])


def _build(cls: type, fields: dict[str, Any]) -> Any:
    try:
        return cls(**{k: _value(v) for k, v in fields.items()})
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"quantization: torchao refuses {cls.__name__}({fields!r}): {exc}") from exc


def _value(value: Any) -> Any:
    if isinstance(value, list):
        return [_value(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind, inner = value["_type"], value["_data"]
    if kind == "torch.dtype":
        dtype = getattr(torch, inner)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"quantization: torch.{inner} is not a dtype in this torch")
        return dtype
    if kind in ENUMS:
        members = _lookup(kind, ENUMS).__members__
        if inner not in members:
            raise ConfigError(f"quantization: {kind} has no member {inner!r} in this torchao")
        return members[inner]
    return _build(_lookup(kind, VALUE_CLASSES), inner)


def _lookup(name: str, table: dict[str, str]) -> Any:
    import importlib

    found = vars(importlib.import_module(table[name])).get(name)
    if not isinstance(found, type):
        raise ConfigError(f"quantization: this torchao has no {name}; tune again with the torchao that saved it")
    return found


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

    def untrusted_settings(self) -> list[str]:
        """From a file: a preset name or an allow-listed JSON form (:func:`json_form_problems`), and a
        ModuleFilter: never an object or a callable."""
        refused = []
        q = self.quantization
        if isinstance(q, dict):
            refused += json_form_problems(q)
        elif not isinstance(q, str):
            refused.append(f"quantization (a {type(q).__name__} object, not data)")
        if self.filter_fn is not None and not isinstance(self.filter_fn, ModuleFilter):
            refused.append("filter_fn (a callable, not a ModuleFilter)")
        return refused

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
