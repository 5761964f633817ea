"""What a manifest's numbers may cost: checked before ``ait.load`` allocates anything for them.

A graph's ranges size the inputs made at load time (the refit check against eager, a JIT
backend's warm-up, ``check=True``): a 17 KB file that claims a batch of 2**22 would make the
loader allocate gigabytes. A graph is accepted when it is consistent with itself (every axis
named in its inputs has a range, each range is ``0 <= min <= opt <= max``, dtypes and devices are
ones aitune writes) and when its largest example
stays under the documented caps below.
"""

from __future__ import annotations

import math

import torch

from ..graph import GraphSpec

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
        largest = math.prod(graph.shape_at(spec, "max"))
        total += largest * dtype.itemsize
        if total > MAX_EXAMPLE_BYTES:
            return (
                f"one example at the graph's max sizes takes over {MAX_EXAMPLE_BYTES} bytes (the documented cap, "
                "docs/security.md): tune with a smaller max range"
            )
    return None
