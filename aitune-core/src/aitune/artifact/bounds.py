"""What a manifest's numbers may cost: checked before ``ait.load`` allocates anything for them.

A graph's ranges size the inputs made at load time (the refit check against eager, a JIT
backend's warm-up, ``check=True``): a 17 KB file that claims a batch of 2**22 would make the
loader allocate gigabytes. A graph is accepted when it is consistent with itself (every axis
named in its inputs has a range, each range is ``0 <= min <= opt <= max`` with opt at least 1
(where max is), dtypes and devices are ones aitune writes, every recorded value range fits its
input's dtype and the embedding rows recorded with it) and when its largest example stays under
the documented caps below. An opt of 0 would make the load check's example empty, so that it
compared nothing.
"""

from __future__ import annotations

import math

import torch

from ..graph import GraphSpec, ValueFacts

MAX_DIM = 1 << 20
"""The largest size any one axis of a saved graph may reach (1,048,576)."""
MAX_RANK = 16
"""The most axes a saved input may have."""
MAX_EXAMPLE_BYTES = 1 << 30
"""The most bytes the inputs of one example at the graph's max sizes may take (1 GiB)."""
GRAPH_DEVICES = ("cpu", "cuda")


def graph_problem(graph: GraphSpec) -> str | None:
    """Why ``graph`` (read from a file) is inconsistent or would cost more than the caps, or None."""
    for name, rng in graph.dims.items():
        if not 0 <= rng.min <= rng.opt <= rng.max:
            return f"the range of {name} is min {rng.min}, opt {rng.opt}, max {rng.max}, not 0 <= min <= opt <= max"
        if rng.opt < 1 <= rng.max:
            return f"the range of {name} has opt {rng.opt}: below 1, an example at opt is empty and checks nothing"
        if rng.max > MAX_DIM:
            return f"{name} reaches {rng.max}, over the cap of {MAX_DIM} for one axis"
    total = 0
    for spec in graph.inputs:
        dtype = getattr(torch, spec.dtype, None) if isinstance(spec.dtype, str) else None
        if not isinstance(dtype, torch.dtype):
            return f"input {spec.path} has the dtype {spec.dtype!r}, which is not a torch dtype"
        device_type = spec.device.split(":", 1)[0] if isinstance(spec.device, str) else None
        if device_type not in GRAPH_DEVICES:
            return f"input {spec.path} is on {spec.device!r}; a file may only name {' or '.join(GRAPH_DEVICES)}"
        if len(spec.shape) != len(spec.dims) or len(spec.shape) > MAX_RANK:
            return f"input {spec.path} has {len(spec.shape)} sizes for {len(spec.dims)} axes (at most {MAX_RANK})"
        for axis, (size, dim) in enumerate(zip(spec.shape, spec.dims)):
            if dim is not None and dim not in graph.dims:
                return f"input {spec.path} axis {axis} names the range {dim!r}, which the graph does not have"
            if not 0 <= size <= MAX_DIM:
                return f"input {spec.path} axis {axis} is {size}, over the cap of {MAX_DIM} for one axis"
        problem = _values_problem(spec.values, dtype)
        if problem:
            return f"input {spec.path}: {problem}"
        largest = math.prod(graph.shape_at(spec, "max"))
        total += largest * dtype.itemsize
        if total > MAX_EXAMPLE_BYTES:
            return (
                f"one example at the graph's max sizes takes over {MAX_EXAMPLE_BYTES} bytes (the documented cap, "
                "docs/security.md): tune with a smaller max range"
            )
    for spec in graph.outputs:
        if spec.values is not None:
            return f"output {spec.path} carries recorded values; only inputs do"
    return None


def _values_problem(facts: ValueFacts | None, dtype: torch.dtype) -> str | None:
    """Why an input's recorded values (read from a file) cannot be its dtype's, or None."""
    if facts is None:
        return None
    if not isinstance(facts.finite, bool):
        return f"the recorded 'finite' is {facts.finite!r}, not true or false"
    if facts.rows is not None and (
        isinstance(facts.rows, bool) or not isinstance(facts.rows, int) or not 1 <= facts.rows <= _INT64[1]
    ):
        return f"the recorded embedding rows {facts.rows!r} are not a count from 1 to {_INT64[1]}"
    if dtype.is_floating_point or dtype.is_complex:
        if facts.low is not None or facts.high is not None or facts.rows is not None:
            return "a floating input carries an integer value range"
        return None
    if facts.rows is not None and dtype == torch.bool:
        return "a bool input carries embedding rows; only integer ids index a table"
    if (facts.low is None) != (facts.high is None):
        return "the recorded value range has one end only"
    if facts.low is None or facts.high is None:
        return None
    try:
        info = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    except TypeError:
        return f"{dtype} has no integer range, yet a value range was recorded"
    lowest, highest = max(info[0], _INT64[0]), min(info[1], _INT64[1])
    if not lowest <= facts.low <= facts.high <= highest:
        return f"the recorded values {facts.low}..{facts.high} are not a range of {dtype} ({lowest}..{highest})"
    if facts.rows is not None and not 0 <= facts.low <= facts.high < facts.rows:
        return f"the recorded values {facts.low}..{facts.high} do not index the recorded {facts.rows} embedding rows"
    return None


_INT64 = (torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max)
"""Inputs are drawn in int64 arithmetic: a range must fit it, whatever the dtype."""
