"""What an exported program loses in ``torch.export.save``/``load`` that its AOTInductor compile needs.

An isolated build compiles, in a worker process, the program the user's process exported and saved.
With torch 2.13 the file alone does not give the worker the program the user's process had:

- **The compiler's ranges of the dynamic sizes.** Export traces a dynamic size in ``[max(2, min),
  max]`` (0/1 specialization: ``ShapeEnv._default_value_range`` in
  ``torch/fx/experimental/symbolic_shapes.py``) and states the user's ``[min, max]`` in
  ``range_constraints``; the graph is traced under the narrower range. ``torch.export.load`` gives
  the new ``ShapeEnv`` the user's range (``GraphModuleDeserializer._parse_sym_expr`` in
  ``torch/_export/serde/serialize.py`` calls ``constrain_symbol_range`` with ``range_constraints``),
  so Inductor meets a size that may be 1 in a graph traced for 2 and up, guards on it with the
  traced size as hint and compiles a package that is wrong below that size: a batch axis fixed at
  the traced size (SegFormer, range 1..2: batch 2 returned for batch 1), or an index computed
  out of bounds (T5: ``index out of bounds: 0 <= tmp2 < 256L`` at batch 1). :func:`compiler_ranges`
  records the live ranges, :func:`restore_ranges` narrows the loaded program's to them.
- **Custom operators.** A program that calls an operator registered from Python (transformers'
  ``transformers::grouped_mm_fallback`` in Mixtral's experts) only loads where that operator is
  registered again; the worker imports none of the model's packages. :func:`operator_modules`
  names the modules that register them, :func:`import_modules` imports them in the worker.
"""

from __future__ import annotations

import importlib
import re
import sys
from typing import Any

import torch

TORCH_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d", "_dtensor", "profiler", "higher_order"})
"""Operator namespaces torch registers from C++ when it is imported: nothing to import for them."""
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _shape_env(program: Any) -> Any:
    """The ``ShapeEnv`` of ``program``'s inputs (the one Inductor compiles under), or None."""
    for node in program.graph.nodes:
        if node.op != "placeholder":
            continue
        fake_mode = getattr(node.meta.get("val"), "fake_mode", None)
        if fake_mode is not None and fake_mode.shape_env is not None:
            return fake_mode.shape_env
    return None


def _bound(value: Any) -> int | None:
    """A range's end as JSON: an int, or None where it is unbounded."""
    from torch.utils._sympy.numbers import int_oo

    return None if value in (int_oo, -int_oo) else int(value)


def compiler_ranges(program: Any) -> dict[str, list[int | None]]:
    """The range each dynamic size of ``program`` was traced under, by symbol name (``s95: [2, 8]``)."""
    shape_env = _shape_env(program)
    if shape_env is None:
        return {}
    ranges: dict[str, list[int | None]] = {}
    for symbol in program.range_constraints:
        found = shape_env.var_to_range.get(symbol)
        if found is not None and getattr(symbol, "is_Symbol", False):
            ranges[str(symbol)] = [_bound(found.lower), _bound(found.upper)]
    return ranges


def restore_ranges(program: Any, ranges: dict[str, list[int | None]]) -> None:
    """Narrow the loaded ``program``'s sizes to the ranges they were traced under (:func:`compiler_ranges`)."""
    from torch.utils._sympy.numbers import int_oo

    shape_env = _shape_env(program)
    if shape_env is None or not ranges:
        return
    for symbol in program.range_constraints:
        bounds = ranges.get(str(symbol))
        if bounds is None or not getattr(symbol, "is_Symbol", False):
            continue
        low, high = bounds
        shape_env.constrain_symbol_range(symbol, -int_oo if low is None else low, int_oo if high is None else high)


def _registered_in(op: torch._ops.OpOverload) -> list[str]:
    """The Python modules that registered ``op``, most specific first (none for a C++ registration)."""
    from torch._library import custom_ops, simple_registry

    names: list[str | None] = []
    opdef = custom_ops.OPDEFS.get(op._schema.name)
    if opdef is not None:  # torch.library.custom_op: the decorated function's module
        names.append(opdef._init_fn.__module__)
    kernel = simple_registry.singleton.find(op._schema.name).fake_impl.kernel
    if kernel is not None:  # register_fake: its function's module
        names.append(getattr(kernel.func, "__module__", None))
    found = re.search(r"^debug: registered at (.+\.py):\d+$", torch._C._dispatch_dump(op._schema.name), re.M)
    if found:  # Library.define: the file that called it
        names += [name for name, m in list(sys.modules.items()) if getattr(m, "__file__", None) == found.group(1)]
    return [n for n in names if n]


def _module_to_import(op: torch._ops.OpOverload) -> str | None:
    """The module whose import registers ``op`` in a fresh process; None when there is none to name
    (a script's ``__main__``, code with no module)."""
    names = _registered_in(op)
    if "__main__" in names:
        return None
    outside = [n for n in names if n != "torch" and not n.startswith("torch.")]
    if outside:
        return outside[0]
    if names:  # torch's own Python registrations (torch.library wrappers): `import torch` loads not all
        return names[0]
    if op.namespace in sys.modules:  # a C++ extension, loaded by its package of that name
        return op.namespace
    return None


def operator_modules(program: Any) -> tuple[list[str], list[str]]:
    """The modules to import before ``torch.export.load`` can resolve ``program``'s operators, and
    the operators registered by something aitune cannot name (their program cannot load elsewhere)."""
    modules: dict[str, None] = {}
    unknown: dict[str, None] = {}
    for graph_module in program.graph_module.modules():
        if not isinstance(graph_module, torch.fx.GraphModule):
            continue
        for node in graph_module.graph.nodes:
            op = node.target
            if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
                continue
            if op.namespace in TORCH_NAMESPACES:
                continue
            module = _module_to_import(op)
            if module is None:
                unknown[str(op)] = None
            else:
                modules[module] = None
    return list(modules), list(unknown)


def import_modules(names: list[str]) -> None:
    """In the worker: import the modules :func:`operator_modules` named, so their operators exist."""
    from aitune.plugin import BuildError

    for name in names:
        if not isinstance(name, str) or not _MODULE_NAME.fullmatch(name):
            raise BuildError(f"the export notes name the module {name!r}, which is not a module name")
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise BuildError(
                f"the worker cannot import {name}, which registers a custom operator the exported program "
                f"calls ({type(exc).__name__}: {exc}); install it where builds run, or build in-process "
                "(AITUNE_ISOLATE=none)"
            ) from exc
