"""The default correctness check of a candidate against eager PyTorch.

A backend that returns finite garbage must fail, so beyond NaN/Inf and shapes every output is
compared numerically against eager, with a bound chosen by dtype (or by the backend, when it
quantizes, or by the user). Inputs must come back unchanged, and each dynamic axis is also run at
its min and max and at sizes no recorded call had (:func:`interior_sizes`): an exported graph may
have dropped a branch the model takes on a shape (``if x.shape[1] == 6``) that the recorded calls
never hit, and only running that shape shows it.

:func:`check_loaded` is ``ait.load``'s check of a payload read from an artifact: a few inputs drawn
from what the graph's inputs took while tuning, at its min, opt and max sizes, where a NaN or an
infinity must sit exactly where eager has one.

On a GPU the eager reference runs fp32 matmuls and convolutions in full fp32 (torch's defaults
let cuDNN convolutions use TF32), unless the candidate computes in TF32 itself
(:meth:`Backend.computes_tf32`), whose fp32 bound is then TF32's (:data:`TF32_TOLERANCE`).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from . import tree
from .backend import DEFAULT_TOLERANCES, Backend, Tolerance
from .graph import GraphSpec, Sample, assemble
from .report import OutputComparison, ValidationReport

TF32_TOLERANCE = Tolerance(atol=1e-4, rtol=5e-3, min_cosine=0.9999)
"""The fp32 bound on a GPU of a candidate that computes in TF32 (10 mantissa bits)."""
_TF32_FLAGS = threading.Lock()
"""torch's TF32 flags are process-wide and tuning may run in a background thread: one switch at a time."""


class _Mismatch(Exception):
    pass


class _NotClose(_Mismatch):
    """The outputs are eager's in form (structure, shape, dtype, finite) but not close enough."""


def tolerance_for(
    dtype: torch.dtype, backend: Backend, overrides: Mapping[str, Any] | None, tf32: bool = False
) -> Tolerance:
    """The user's bound for ``dtype``, else the backend's, else TF32's for fp32 when ``tf32``, else the dtype's."""
    name = str(dtype).removeprefix("torch.")
    if overrides and name in overrides:
        return overrides[name]
    own = backend.tolerance(dtype)
    if own is not None:
        return own
    if tf32 and dtype == torch.float32:
        return TF32_TOLERANCE
    return DEFAULT_TOLERANCES.get(name, DEFAULT_TOLERANCES["float32"])


@contextlib.contextmanager
def full_fp32() -> Iterator[None]:
    """CUDA fp32 matmuls, cuDNN convolutions and cuDNN RNNs (LSTM, GRU: torch 2.13 defaults their
    ``fp32_precision`` to TF32) in IEEE fp32 while the block runs, then torch's flags as they were.
    Uses ``fp32_precision`` where torch has it (2.9 and later; mixing it with the ``allow_tf32``
    flags makes torch refuse to read them), else the ``allow_tf32`` flags (which cover RNNs too)."""
    backends = torch.backends
    with _TF32_FLAGS:
        if hasattr(backends.cudnn, "conv") and hasattr(backends.cuda.matmul, "fp32_precision"):
            flags = [backends.cuda.matmul, backends.cudnn.conv]
            if hasattr(getattr(backends.cudnn, "rnn", None), "fp32_precision"):
                flags.append(backends.cudnn.rnn)
            saved = [flag.fp32_precision for flag in flags]
            try:
                for flag in flags:
                    flag.fp32_precision = "ieee"
                yield
            finally:
                for flag, value in zip(flags, saved):
                    flag.fp32_precision = value
        else:
            saved_flags = (backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32)
            try:
                backends.cuda.matmul.allow_tf32 = backends.cudnn.allow_tf32 = False
                yield
            finally:
                backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32 = saved_flags


def _eager_answer(reference: Callable[..., Any], sample: Sample, tf32: bool) -> tuple[Any, Sample]:
    """Eager's answer on a fresh copy of ``sample`` (returned too: a call may update its inputs), in
    full fp32 on a GPU unless the candidate itself computes in TF32."""
    inputs = sample.fresh()
    with full_fp32() if _on_cuda(sample) and not tf32 else contextlib.nullcontext():
        return reference(*inputs.args, **inputs.kwargs), inputs


def _on_cuda(sample: Sample) -> bool:
    return any(t.is_cuda for t in sample.tensors())


def validate(
    backend: Backend,
    reference: Callable[..., Any],
    samples: Sequence[Sample],
    graph: GraphSpec,
    tolerances: Mapping[str, Any] | None = None,
    masked_by: str | None = None,
) -> ValidationReport:
    """Run ``backend`` and ``reference`` on every sample (and the dynamic extremes) and compare.

    ``masked_by`` names the input holding an attention mask (``[batch, seq]``, nonzero where a
    position counts): outputs whose leading axes are ``[batch, seq]`` are then compared at the
    unmasked positions only, since padded positions carry no meaning and backends fill them
    differently (``ait.Module(..., compare="unmasked")``).
    """
    report = ValidationReport(passed=True)
    comparisons: dict[str, OutputComparison] = {}
    cases: list[tuple[str, Sample]] = [(f"sample {i}", s) for i, s in enumerate(samples)]
    if masked_by is not None:
        report.checks.append(f"unmasked positions only (mask: {masked_by})")
    if samples and graph.dims:
        for which in ("min", "max"):
            sizes = {name: getattr(rng, which) for name, rng in graph.dims.items()}
            label = ", ".join(f"{n}={v}" for n, v in sizes.items())
            cases.append((f"{which} shapes ({label})", assemble(graph, samples, sizes)))
            report.checks.append(f"{which} shapes ({label})")
        for name, values in interior_sizes(graph, samples).items():
            others = {n: rng.opt for n, rng in graph.dims.items() if n != name}
            for value in values:
                cases.append((f"{name}={value}", assemble(graph, samples, {**others, name: value})))
            report.checks.append(f"unrecorded {name} sizes {values} (others at opt)")
    recorded = len(samples)
    tf32 = backend.computes_tf32()
    if samples and _on_cuda(samples[0]):
        report.checks.append("eager reference under torch's TF32 flags" if tf32 else "eager reference in full fp32")
    try:
        for index, (label, sample) in enumerate(cases):
            on_gpu = _on_cuda(sample)
            try:
                expected, eager_inputs = _eager_answer(reference, sample, tf32)
            except Exception as exc:
                if index < recorded:
                    raise
                # a size the model itself refuses (a patch size, a divisor): nothing to compare there
                report.checks.append(f"{label}: skipped, eager raises {type(exc).__name__}")
                continue
            mask = _mask_of(graph, sample, masked_by) if masked_by is not None else None
            _check_one(backend, expected, eager_inputs, sample, tolerances, comparisons, label, mask, on_gpu and tf32)
            report.samples_checked += 1
    except _Mismatch as exc:
        report.passed = False
        report.reason = str(exc)
        report.closeness_only = isinstance(exc, _NotClose)
    except Exception as exc:  # the candidate crashed while running: that is a failed validation
        report.passed = False
        report.reason = f"running the candidate raised {type(exc).__name__}: {exc}"
    report.outputs = list(comparisons.values())
    return report


LOAD_CHECK_CASES = (("min", False), ("opt", False), ("max", False), ("opt", True))
"""``ait.load``'s check: the sizes each call runs at, and whether its integers are shuffled (else
swept on from the rows before it, see :func:`aitune.graph.draw`). Four calls of the payload and four
of eager per graph, one at the graph's max sizes."""


@attrs.define
class LoadCheck:
    """What :func:`check_loaded` found."""

    reason: str | None = None
    """Why the payload does not answer as eager does, or None."""
    checked: int = 0
    """Calls compared (a call eager itself refuses is skipped)."""
    skipped: list[str] = attrs.field(factory=list)
    """Each skipped call and the error eager raised."""
    eager_nan: bool = False
    """Some output of eager held a NaN (which the payload then matched, position by position)."""


def check_loaded(
    backend: Backend,
    reference: Callable[..., Any],
    graph: GraphSpec,
    tolerances: Mapping[str, Any] | None = None,
    masked_by: str | None = None,
) -> LoadCheck:
    """Run ``backend`` (a payload read from a file) and ``reference`` (eager, with the artifact's
    weights) on the inputs of :data:`LOAD_CHECK_CASES` and compare, strictly about non-finite values.

    Each call's inputs are drawn from the graph's recorded :class:`~aitune.graph.ValueFacts`, so
    integer inputs run through their tuned range (its ends first) and masks pad some positions; a
    payload that answers otherwise on some sizes (a branch on the batch size), some values (an
    embedding row, a token) or with NaN where eager is finite, or finite where eager is not (weights
    that are not the payload's), is caught. A call eager itself raises on is skipped. ``masked_by``
    as for :func:`validate`: the padded positions of that mask input are left out.
    """
    result = LoadCheck()
    comparisons: dict[str, OutputComparison] = {}
    tf32 = backend.computes_tf32()
    row = 0
    for which, shuffled in LOAD_CHECK_CASES:
        sample = graph.example(which, row=row, shuffled=shuffled)
        tensors = sample.tensors()
        row += max((math.prod(t.shape[:-1]) if t.dim() else 1 for t in tensors), default=1)
        label = f"{which} shapes, {'shuffled' if shuffled else 'swept'} values"
        on_gpu = _on_cuda(sample)
        try:
            expected, eager_inputs = _eager_answer(reference, sample, tf32)
        except Exception as exc:
            result.skipped.append(f"{label}: eager raises {type(exc).__name__}: {exc}")
            continue
        result.eager_nan = result.eager_nan or any(
            bool(torch.isnan(t).any()) for t in tree.flatten(expected)[0] if t.is_floating_point() or t.is_complex()
        )
        try:
            _check_one(
                backend,
                expected,
                eager_inputs,
                sample,
                tolerances,
                comparisons,
                label,
                _mask_of(graph, sample, masked_by) if masked_by is not None else None,
                tf32=on_gpu and tf32,
                strict=True,
            )
        except _Mismatch as exc:
            result.reason = str(exc)
            return result
        except Exception as exc:  # the payload crashed on inputs eager takes
            result.reason = f"{label}: running the payload raised {type(exc).__name__}: {exc}"
            return result
        result.checked += 1
    return result


MAX_INTERIOR = 16
"""Sizes of one dynamic axis checked beyond what was recorded: every size of a range up to this
wide, else this many spread over it. Bounds what validation costs."""


def interior_sizes(graph: GraphSpec, samples: Sequence[Sample]) -> dict[str, list[int]]:
    """Per dynamic axis, the sizes inside its range that no recorded call had (ends excluded: they
    are checked already): all of them for a range of at most :data:`MAX_INTERIOR` sizes, else that
    many spread evenly over the range."""
    recorded: dict[str, set[int]] = {name: set() for name in graph.dims}
    for sample in samples:
        try:
            tensors = graph.flatten(sample.args, sample.kwargs)
        except Exception:
            continue
        for tensor, spec in zip(tensors, graph.inputs):
            for axis, name in enumerate(spec.dims):
                if name in recorded and axis < tensor.dim():
                    recorded[name].add(int(tensor.shape[axis]))
    out: dict[str, list[int]] = {}
    for name, rng in graph.dims.items():
        if rng.max - rng.min - 1 > MAX_INTERIOR:
            step = (rng.max - rng.min) / (MAX_INTERIOR + 1)
            picked = sorted({round(rng.min + step * (i + 1)) for i in range(MAX_INTERIOR)})
        else:
            picked = list(range(rng.min + 1, rng.max))
        values = [v for v in picked if v not in recorded[name] and rng.min < v < rng.max]
        if values:
            out[name] = values
    return out


def _check_one(
    backend: Backend,
    expected: Any,
    eager_inputs: Sample,
    sample: Sample,
    tolerances: Mapping[str, Any] | None,
    comparisons: dict[str, OutputComparison],
    label: str,
    mask: torch.Tensor | None = None,
    tf32: bool = False,
    strict: bool = False,
) -> None:
    """One case: the candidate's outputs against eager's, and its inputs after the call against
    what eager left in them (unchanged, or updated in place as a static KV cache is). ``strict``:
    NaN and infinities must match eager's position by position (:func:`_compare`)."""
    mine = sample.fresh()
    actual = backend.infer(*mine.args, **mine.kwargs)
    before = sample.tensors()
    eager_after, after = eager_inputs.tensors(), mine.tensors()
    for i, (b, e, a) in enumerate(zip(before, eager_after, after)):
        if torch.equal(e, a):
            continue
        if torch.equal(b, e):
            raise _Mismatch(f"{label}: the candidate modified input tensor {i} in place (eager does not)")
        path = f"input {i} after the call"
        _compare(
            label,
            path,
            e,
            a.to(e.device),
            tolerance_for(e.dtype, backend, tolerances, tf32),
            OutputComparison(path),
            strict,
        )

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
        act = act.to(exp.device)
        if mask is not None and exp.dim() >= 2 and tuple(exp.shape[:2]) == tuple(mask.shape):
            keep = mask.to(exp.device) != 0
            exp, act = exp[keep], act[keep]
        _compare(label, path, exp, act, tolerance_for(exp.dtype, backend, tolerances, tf32), cmp, strict)


def _mask_of(graph: GraphSpec, sample: Sample, name: str) -> torch.Tensor | None:
    """The mask input ``name`` of ``sample`` (a keyword, or the positional argument of that name)."""
    value = sample.kwargs.get(name)
    if value is None and name in graph.arg_names:
        index = graph.arg_names.index(name)
        value = sample.args[index] if index < len(sample.args) else None
    return value if isinstance(value, torch.Tensor) and value.dim() == 2 else None


def _compare(
    label: str,
    path: str,
    exp: torch.Tensor,
    act: torch.Tensor,
    tol: Tolerance,
    cmp: OutputComparison,
    strict: bool = False,
) -> None:
    """Shapes were compared already; the values here. A NaN or infinity where eager is finite fails;
    where eager has one, the position is left out, unless ``strict``: then the candidate must have
    the same there (a NaN, or the same infinity), so finite answers where eager's weights give NaN
    fail too."""
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
    if strict:
        same = (torch.isnan(e) & torch.isnan(a)) | (e == a)
        other = same_nonfinite & ~same
        if bool(other.any()):
            raise _Mismatch(
                f"{label}: output {path} is not NaN or infinite at {int(other.sum())} positions where eager is "
                "(or another infinity)"
            )
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
        raise _NotClose(
            f"{label}: output {path} is off by {abs_err:.3g} (relative {rel_err:.3g}), above the bound "
            f"atol {tol.atol:g} + rtol {tol.rtol:g} x max|eager| {scale:.3g}"
        )
    if e.numel() > 1 and cosine < tol.min_cosine:
        raise _NotClose(f"{label}: output {path} has cosine similarity {cosine:.6f} < {tol.min_cosine}")
