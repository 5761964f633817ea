"""The default correctness check of a candidate against eager PyTorch.

A backend that returns finite garbage must fail, so beyond NaN/Inf and shapes every output is
compared numerically against eager, with a bound chosen by dtype (or by the backend, when it
quantizes, or by the user). Inputs must come back unchanged, and each dynamic axis is also run at
its min and max.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import tree
from .backend import Backend, Tolerance
from .graph import GraphSpec, Sample, assemble
from .report import OutputComparison, ValidationReport

DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(atol=1e-7, rtol=1e-5, min_cosine=0.99999),
    "float32": Tolerance(atol=1e-5, rtol=1e-3, min_cosine=0.9999),
    "float16": Tolerance(atol=1e-3, rtol=1e-2, min_cosine=0.999),
    "bfloat16": Tolerance(atol=1e-2, rtol=5e-2, min_cosine=0.99),
}
"""Bounds for floating outputs by dtype; integer and bool outputs must match exactly."""


class _Mismatch(Exception):
    pass


def tolerance_for(dtype: torch.dtype, backend: Backend, overrides: Mapping[str, Any] | None) -> Tolerance:
    name = str(dtype).removeprefix("torch.")
    if overrides and name in overrides:
        return overrides[name]  # type: ignore[no-any-return]
    own = backend.tolerance(dtype)
    if own is not None:
        return own
    return DEFAULT_TOLERANCES.get(name, DEFAULT_TOLERANCES["float32"])


def validate(
    backend: Backend,
    reference: Callable[..., Any],
    samples: Sequence[Sample],
    graph: GraphSpec,
    tolerances: Mapping[str, Any] | None = None,
) -> ValidationReport:
    """Run ``backend`` and ``reference`` on every sample (and the dynamic extremes) and compare."""
    report = ValidationReport(passed=True)
    comparisons: dict[str, OutputComparison] = {}
    cases: list[tuple[str, Sample]] = [(f"sample {i}", s) for i, s in enumerate(samples)]
    if samples and graph.dims:
        for which in ("min", "max"):
            sizes = {name: getattr(rng, which) for name, rng in graph.dims.items()}
            label = ", ".join(f"{n}={v}" for n, v in sizes.items())
            cases.append((f"{which} shapes ({label})", assemble(graph, samples, sizes)))
            report.checks.append(f"{which} shapes ({label})")
    try:
        for label, sample in cases:
            _check_one(backend, reference, sample, tolerances, comparisons, label)
            report.samples_checked += 1
    except _Mismatch as exc:
        report.passed = False
        report.reason = str(exc)
    except Exception as exc:  # the candidate crashed while running: that is a failed validation
        report.passed = False
        report.reason = f"running the candidate raised {type(exc).__name__}: {exc}"
    report.outputs = list(comparisons.values())
    return report


def _check_one(
    backend: Backend,
    reference: Callable[..., Any],
    sample: Sample,
    tolerances: Mapping[str, Any] | None,
    comparisons: dict[str, OutputComparison],
    label: str,
) -> None:
    expected = reference(*copy.deepcopy(sample.args), **copy.deepcopy(sample.kwargs))
    args, kwargs = copy.deepcopy(sample.args), copy.deepcopy(sample.kwargs)
    actual = backend.infer(*args, **kwargs)
    before = tree.flatten((sample.args, sample.kwargs))[0]
    after = tree.flatten((args, kwargs))[0]
    for i, (b, a) in enumerate(zip(before, after)):
        if not torch.equal(b, a):
            raise _Mismatch(f"{label}: the candidate modified input tensor {i} in place (eager does not)")

    exp_leaves, exp_struct = tree.flatten(expected)
    act_leaves, act_struct = tree.flatten(actual)
    if exp_struct != act_struct:
        raise _Mismatch(f"{label}: output structure differs from eager: {act_struct} vs {exp_struct}")
    paths = tree.leaf_paths(exp_struct) or [""]
    for path, exp, act in zip(paths, exp_leaves, act_leaves):
        path = path or "output"
        if act.shape != exp.shape:
            raise _Mismatch(f"{label}: output {path} has shape {tuple(act.shape)}, eager {tuple(exp.shape)}")
        if act.dtype != exp.dtype:
            raise _Mismatch(f"{label}: output {path} has dtype {act.dtype}, eager {exp.dtype}")
        cmp = comparisons.setdefault(path, OutputComparison(path))
        _compare(label, path, exp, act.to(exp.device), tolerance_for(exp.dtype, backend, tolerances), cmp)


def _compare(
    label: str, path: str, exp: torch.Tensor, act: torch.Tensor, tol: Tolerance, cmp: OutputComparison
) -> None:
    if not (exp.dtype.is_floating_point or exp.dtype.is_complex):
        if not torch.equal(exp, act):
            wrong = int((exp != act).sum())
            raise _Mismatch(f"{label}: output {path} differs from eager in {wrong} of {exp.numel()} elements")
        return
    e, a = exp.detach().double(), act.detach().double()
    bad = torch.isfinite(e) & ~torch.isfinite(a)
    if bool(bad.any()):
        raise _Mismatch(f"{label}: output {path} has {int(bad.sum())} NaN/Inf values where eager is finite")
    same_nonfinite = ~torch.isfinite(e)
    if bool(same_nonfinite.any()):
        e, a = e.masked_fill(same_nonfinite, 0.0), a.masked_fill(same_nonfinite, 0.0)
    if e.numel() == 0:
        return
    abs_err = float((a - e).abs().max())
    scale = float(e.abs().max())
    rel_err = abs_err / scale if scale > 0 else (0.0 if abs_err == 0 else float("inf"))
    en, an = e.flatten(), a.flatten()
    norms = float(en.norm() * an.norm())
    cosine = float(torch.dot(en, an) / norms) if norms > 0 else (1.0 if abs_err == 0 else 0.0)
    cmp.max_abs_error = max(cmp.max_abs_error, abs_err)
    cmp.max_rel_error = max(cmp.max_rel_error, rel_err)
    cmp.cosine_similarity = min(cmp.cosine_similarity, cosine)
    if abs_err > tol.atol + tol.rtol * scale:
        raise _Mismatch(
            f"{label}: output {path} is off by {abs_err:.3g} (relative {rel_err:.3g}), above the bound "
            f"atol {tol.atol:g} + rtol {tol.rtol:g} x max|eager| {scale:.3g}"
        )
    if e.numel() > 1 and cosine < tol.min_cosine:
        raise _Mismatch(f"{label}: output {path} has cosine similarity {cosine:.6f} < {tol.min_cosine}")
