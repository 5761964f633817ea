"""What aitune reads from a module: digests of its code and of the whole module, and whether it reads ``self.training``.

Cache keys must change when ``forward`` changes, not only when the weights do, so the digest
covers every class in the module tree: its qualified name and the bytecode of each method it
defines (with constants, names and nested code). Bytecode, unlike source, exists for classes
made in a notebook or by ``exec``, and ignores comments and line moves. Classes from torch itself
are named but not hashed: the torch version is in every key already.

Nor only when the code does: two instances of one class can take other branches of the same
``forward`` (a flag set in ``__init__``, a ``transformers`` config's attention implementation), so
the module digest also covers each submodule's plain attributes (:func:`settings`), written out
from their values, never from ``repr`` of an object (an address would change every process).
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import sys
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch

_SKIPPED = (torch.nn.Module, object)


def _classes(module: torch.nn.Module) -> Iterator[type]:
    """Every class in the module tree and their bases, each once, in a stable order."""
    seen: set[type] = set()
    for sub in module.modules():
        for cls in type(sub).__mro__:
            if cls not in seen and cls not in _SKIPPED:
                seen.add(cls)
                yield cls


def _own_code(cls: type) -> bool:
    """False for torch's own classes: their code is fixed by the torch version."""
    return not (cls.__module__ == "torch" or cls.__module__.startswith("torch."))


def _functions(cls: type) -> Iterator[tuple[str, types.CodeType]]:
    for name, value in sorted(vars(cls).items()):
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        code = getattr(value, "__code__", None)
        if isinstance(code, types.CodeType):
            yield name, code


def _update(digest: Any, code: types.CodeType) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _update(digest, const)
        elif isinstance(const, frozenset):  # its order follows string hashing, which differs per process
            digest.update(repr(sorted(map(repr, const))).encode())
        else:
            digest.update(repr(const).encode())


def code_digest(module: torch.nn.Module) -> str:
    """SHA-256 of the code ``module`` runs: each class's name and its methods' bytecode, plus the Python version."""
    digest = hashlib.sha256(f"python {sys.version_info[0]}.{sys.version_info[1]}\n".encode())
    for cls in _classes(module):
        digest.update(f"{cls.__module__}.{cls.__qualname__}\n".encode())
        if _own_code(cls):
            for name, code in _functions(cls):
                digest.update(f"{name}:".encode())
                _update(digest, code)
    for sub in module.modules():  # a forward set on the instance replaces the class's
        own = sub.__dict__.get("forward")
        instance_code = getattr(getattr(own, "__func__", own), "__code__", None)
        if isinstance(instance_code, types.CodeType):
            _update(digest, instance_code)
    return digest.hexdigest()


def _reads(code: types.CodeType, name: str) -> bool:
    if name in code.co_names:
        return True
    return any(isinstance(c, types.CodeType) and _reads(c, name) for c in code.co_consts)


def reads_training(module: torch.nn.Module) -> bool:
    """Whether any forward in the tree can behave differently in training mode (Dropout, BatchNorm, ...).

    True when a method of a class in the tree (torch's own included, ``train`` and ``eval`` excepted)
    mentions ``training``: in training mode such a module's outputs differ from eval mode's.
    """
    for cls in _classes(module):
        for name, code in _functions(cls):
            if name not in ("train", "eval") and _reads(code, "training"):
                return True
    return False


_DEPTH = 8
"""How deep :func:`settings` follows containers and objects (an object and its attributes' dict
are two levels: a module's config, its sub-config and their values are six)."""


def settings(module: torch.nn.Module) -> str:
    """Each submodule's own attributes other than its parameters, buffers and children, as text.

    What a traced graph can depend on besides code and weights: flags, sizes, names, configs. Each
    object is written once per call (a config every layer holds is written where first met).
    """
    seen: dict[int, tuple[object, str]] = {}  # each object held, so no id is reused during the call
    lines = []
    for name, sub in module.named_modules():
        own = {k: v for k, v in vars(sub).items() if not k.startswith("_")}
        lines.append(f"{name or '.'}: {_written(own, _DEPTH, seen)}")
    return "\n".join(lines)


def _written(value: Any, depth: int, seen: dict[int, tuple[object, str]]) -> str:
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, torch.Tensor):  # a plain tensor attribute: traced in as a constant
        t = value.detach().to("cpu").contiguous()
        data = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""
        return f"tensor({t.dtype}, {tuple(t.shape)}, {hashlib.blake2b(data, digest_size=16).hexdigest()})"
    if isinstance(value, torch.nn.Module):  # a child is written under its own name; a shared one by its type
        return f"module {type(value).__qualname__}"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return f"{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    if id(value) in seen:
        return seen[id(value)][1]
    if depth == 0:
        return type(value).__qualname__
    seen[id(value)] = (value, type(value).__qualname__)  # a cycle back to it: its type
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_written(v, depth - 1, seen) for v in value]
        text = (
            f"{type(value).__qualname__}[{', '.join(sorted(items) if isinstance(value, (set, frozenset)) else items)}]"
        )
    elif isinstance(value, dict):
        pairs = sorted(f"{_written(k, depth - 1, seen)}: {_written(v, depth - 1, seen)}" for k, v in value.items())
        text = f"{{{', '.join(pairs)}}}"
    else:  # an object (a config): its own attributes, or its type where it keeps none
        attrs = getattr(value, "__dict__", None)
        text = type(value).__qualname__
        if isinstance(attrs, dict):
            text += _written(attrs, depth - 1, seen)
    seen[id(value)] = (value, text)
    return text


_module_digests: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, str]] = weakref.WeakKeyDictionary()
"""Per live module (never by ``id()``, which a new module can reuse): its weights' stamp and digest."""


def module_digest(module: torch.nn.Module) -> str:
    """SHA-256 of the module's code, structure, settings and every weight; memoized while those are unchanged.

    The key of a cached build and of a remembered JIT decision.
    """
    state = module.state_dict(keep_vars=True)
    code = code_digest(module)
    written = settings(module)
    stamp = (code, written, tuple((k, v.data_ptr(), v._version, tuple(v.shape)) for k, v in state.items()))
    cached = _module_digests.get(module)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    head = f"{type(module).__module__}.{type(module).__qualname__}\n{code}\n{module}\n{written}"
    digest = hashlib.sha256(head.encode())
    for name, tensor in state.items():
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.numel():  # raw bytes through ctypes: torch's CPU wheel does not bring numpy
            digest.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    _module_digests[module] = (stamp, digest.hexdigest())
    return digest.hexdigest()
