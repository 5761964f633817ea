"""``ait.inspect``: where the time goes in a model or pipeline, and which modules to tune.

It runs the pipeline a few times with forward hooks on every submodule, measuring call counts,
inclusive time, parameters and input shapes, optionally asks ``torch._dynamo.explain`` about
graph breaks, and recommends the largest non-overlapping modules that take most of the time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch

from .. import tree
from ..errors import InputError
from .module import Module
from .tuner import call_with_item


@attrs.define
class ModuleInfo:
    name: str
    type: str
    calls: int = 0
    total_ms: float = 0.0
    share: float = 0.0
    """Fraction of the pipeline's time spent inside this module (children included)."""
    parameters: int = 0
    input_shapes: list[list[int]] = attrs.field(factory=list)
    graph_breaks: int | None = None
    break_reasons: list[str] = attrs.field(factory=list)
    recommended: bool = False
    why: str = ""


@attrs.define
class InspectResult:
    total_ms: float
    runs: int
    modules: dict[str, ModuleInfo]

    @property
    def recommended(self) -> list[str]:
        return [n for n, m in self.modules.items() if m.recommended]

    def get_modules(self, min_execution_ratio: float | None = None, limit: int | None = None) -> list[ModuleInfo]:
        """The modules that ran, largest share of time first, for ``ait.wrap(obj, modules)`` (AITune's API).

        ``min_execution_ratio`` keeps modules taking at least that fraction of the time; ``limit``
        keeps the first N. A module and its children are both listed (``recommended`` marks the
        non-overlapping choice); the model itself is not, since it is wrapped as ``ait.Module(model)``.
        """
        if min_execution_ratio is not None and not 0 <= min_execution_ratio <= 1:
            raise InputError(f"min_execution_ratio is a fraction of the time in [0, 1], got {min_execution_ratio!r}")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise InputError(f"limit must be an int >= 0, got {limit!r}")
        ran = [m for m in self.modules.values() if m.name and m.calls > 0]
        if min_execution_ratio is not None:
            ran = [m for m in ran if m.share >= min_execution_ratio]
        ran.sort(key=lambda m: (-m.share, m.name.count("."), m.name))
        return ran if limit is None else ran[:limit]

    def max_speedup(self, modules: Sequence[str] | None = None, module_speedup: float = float("inf")) -> float:
        """The most the whole can gain when ``modules`` (default: the recommended ones) each run
        ``module_speedup`` times faster and the rest stays as it is (Amdahl's law). A tune whose
        modules win big while this is near 1 wrapped the wrong part."""
        names = self.recommended if modules is None else list(modules)
        share = min(1.0, sum(self.modules[n].share for n in names if n in self.modules))
        rest = 1.0 - share + share / module_speedup
        return 1.0 / rest if rest > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        from ..converter import unstructure

        return unstructure(self)

    def describe(self, limit: int = 25) -> str:
        """A table of the modules that take most of the time; also printed when in a terminal."""
        from io import StringIO

        from rich.console import Console
        from rich.table import Table

        title = f"aitune inspect: {self.runs} runs, {self.total_ms / max(self.runs, 1):.2f} ms per run"
        if self.recommended:
            bound = self.max_speedup()
            title += (
                f"; tuning the recommended modules gains at most "
                f"{'unbounded' if bound == float('inf') else f'{bound:.2f}x'} end to end (Amdahl)"
            )
        table = Table(title=title)
        for column in ("module", "type", "calls", "share", "params", "inputs", "graph breaks", "tune?"):
            table.add_column(column, overflow="fold")  # long module paths wrap, never get cut
        ordered = sorted(self.modules.values(), key=lambda m: -m.total_ms)[:limit]
        for m in ordered:
            table.add_row(
                m.name or "(root)",
                m.type,
                str(m.calls),
                f"{m.share:.0%}",
                f"{m.parameters:,}",
                " ".join("x".join(map(str, s)) for s in m.input_shapes[:3]),
                "-" if m.graph_breaks is None else str(m.graph_breaks),
                ("yes: " + m.why) if m.recommended else m.why,
            )
        out = StringIO()
        Console(file=out, width=160).print(table)
        return out.getvalue()


def _roots(obj: Any) -> dict[str, torch.nn.Module]:
    if isinstance(obj, torch.nn.Module):
        return {"": obj}
    found = {k: v for k, v in vars(obj).items() if isinstance(v, torch.nn.Module)} if hasattr(obj, "__dict__") else {}
    if isinstance(obj, dict):
        found = {k: v for k, v in obj.items() if isinstance(v, torch.nn.Module)}
    if not found:
        raise InputError(f"found no torch.nn.Module in {type(obj).__name__}; pass a model or a pipeline holding models")
    return found


def inspect(
    obj: Any,
    dataset: Iterable[Any],
    inference_function: Callable[[Any, Any], Any] | None = None,
    *,
    runs: int = 3,
    detect_graph_breaks: bool = True,
    min_share: float = 0.2,
) -> InspectResult:
    """Run ``obj`` over ``dataset`` ``runs`` times and describe its module tree.

    ``inference_function(obj, sample)`` runs one sample (default: call ``obj`` with it).
    Recommended modules take at least ``min_share`` of the time, have parameters, and do not sit
    inside another recommended module; graph breaks demote a module in favour of its children.
    """
    samples = list(dataset)
    if not samples:
        raise InputError("the dataset is empty: give ait.inspect at least one input batch")
    run = inference_function or (lambda o, s: call_with_item(o, s))
    with torch.no_grad():
        run(obj, samples[0])  # warm-up (lazy init, allocator), before any hook is timing
    infos: dict[str, ModuleInfo] = {}
    modules: dict[str, torch.nn.Module] = {}
    stack: list[float] = []
    handles = []
    for prefix, root in _roots(obj).items():
        for name, module in root.named_modules(prefix=prefix):
            if isinstance(module, Module):
                continue
            name = name.replace(".module.", ".").removesuffix(".module")
            info = infos.setdefault(name, ModuleInfo(name, type(module).__name__))
            info.parameters = sum(p.numel() for p in module.parameters())
            modules[name] = module

            def pre(mod: torch.nn.Module, args: Any, kwargs: Any) -> None:
                stack.append(time.perf_counter())

            def post(mod: torch.nn.Module, args: Any, kwargs: Any, out: Any, info: ModuleInfo = info) -> None:
                info.total_ms += (time.perf_counter() - stack.pop()) * 1000
                info.calls += 1
                if len(info.input_shapes) < 3:
                    shapes = [list(t.shape) for t in tree.flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                    if shapes and shapes[0] not in info.input_shapes:
                        info.input_shapes.append(shapes[0])

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            start = time.perf_counter()
            for _ in range(runs):
                for sample in samples:
                    run(obj, sample)
            total_ms = (time.perf_counter() - start) * 1000
    finally:
        for h in handles:
            h.remove()
    for info in infos.values():
        info.share = info.total_ms / total_ms if total_ms > 0 else 0.0
    _recommend(infos, modules, samples, run, obj, detect_graph_breaks, min_share)
    return InspectResult(total_ms=total_ms, runs=runs, modules=infos)


def _recommend(
    infos: dict[str, ModuleInfo],
    modules: dict[str, torch.nn.Module],
    samples: list[Any],
    run: Callable[[Any, Any], Any],
    obj: Any,
    detect_graph_breaks: bool,
    min_share: float,
) -> None:
    chosen: list[str] = []
    for name in sorted(infos, key=lambda n: (n.count("."), n)):
        info = infos[name]
        if info.share < min_share or info.parameters == 0 or info.calls == 0:
            continue
        if any(name == c or name.startswith(c + ".") or c == "" for c in chosen):
            continue
        if detect_graph_breaks:
            _graph_breaks(info, modules[name], samples, run, obj)
            if info.graph_breaks:
                info.why = "has graph breaks; its children are considered instead"
                continue
        info.recommended = True
        info.why = f"{info.share:.0%} of the time, {info.parameters:,} parameters"
        chosen.append(name)


def _graph_breaks(
    info: ModuleInfo, module: torch.nn.Module, samples: list[Any], run: Callable[[Any, Any], Any], obj: Any
) -> None:
    captured: list[tuple[Any, Any]] = []

    def grab(mod: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not captured:
            captured.append((args, kwargs))

    handle = module.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            run(obj, samples[0])
    finally:
        handle.remove()
    if not captured:
        return
    args, kwargs = captured[0]
    try:
        import torch._dynamo as dynamo

        dynamo.reset()
        explanation = dynamo.explain(module)(*args, **kwargs)
    except Exception as exc:  # explain itself failing is a reason not to compile this module whole
        info.graph_breaks, info.break_reasons = 1, [f"torch._dynamo.explain failed: {type(exc).__name__}: {exc}"]
        return
    # explain counts graphs less one, so a break whose code after it runs no tensor op (a branch not
    # taken) is not counted; each break it records a reason for is one
    info.graph_breaks = max(int(explanation.graph_break_count), len(explanation.break_reasons))
    info.break_reasons = [str(getattr(b, "reason", b)) for b in explanation.break_reasons][:5]
