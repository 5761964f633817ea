"""Comparing a tuned or loaded output with eager PyTorch in tests, on any CPU.

Two separately computed floats differ in their last digits from one machine to the next (Intel or
AMD, with or without AVX-512, one thread or two, another backend's kernels). A test that asks for
equality, or for 1e-6, passes where it was written and fails elsewhere. So tests compare against
the bound aitune itself validates with: ``max|actual - eager| <= atol + rtol * max|eager|`` per
floating tensor, by dtype; integer and bool tensors must match exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..validation import DEFAULT_TOLERANCES


def assert_matches_eager(actual: Any, expected: Any, *, rtol: float | None = None, atol: float | None = None) -> None:
    """Assert ``actual`` has ``expected``'s structure and types, and its numbers within the bound.

    ``rtol``/``atol`` override the dtype's default bound (a quantizing backend's looser one, say).
    """
    got, got_spec = pytree.tree_flatten(actual)
    want, want_spec = pytree.tree_flatten(expected)
    assert got_spec == want_spec, f"structure differs: {got_spec} vs eager {want_spec}"
    for i, (a, e) in enumerate(zip(got, want)):
        if not isinstance(e, torch.Tensor):
            assert a == e, f"leaf {i}: {a!r} vs eager {e!r}"
            continue
        assert isinstance(a, torch.Tensor), f"leaf {i}: {type(a).__name__} where eager returns a tensor"
        assert a.shape == e.shape and a.dtype == e.dtype, (
            f"leaf {i}: {a.dtype}{list(a.shape)} vs eager {e.dtype}{list(e.shape)}"
        )
        a, e = a.detach().cpu(), e.detach().cpu()
        if not e.is_floating_point():
            assert torch.equal(a, e), f"leaf {i}: integer values differ from eager"
            continue
        tol = DEFAULT_TOLERANCES.get(str(e.dtype).removeprefix("torch."), DEFAULT_TOLERANCES["float32"])
        bound = (tol.atol if atol is None else atol) + (tol.rtol if rtol is None else rtol) * float(e.abs().max())
        err = float((a.double() - e.double()).abs().max()) if e.numel() else 0.0
        assert err <= bound, f"leaf {i}: max |actual - eager| = {err:.3g} exceeds the bound {bound:.3g}"
