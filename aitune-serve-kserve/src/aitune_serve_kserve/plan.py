"""The Open Inference Protocol's side of a loaded artifact: its inputs' and outputs' datatypes and
shapes (-1 on the dynamic axes) as the metadata lists them.

What the artifact says about serving it (its inputs, the batch sizes it was tuned for) is every
engine's: :mod:`aitune.torch.serving`. This module only names it in the protocol's terms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy
import torch

import aitune.torch as ait
from aitune.torch.serving import InputSpec, model_graph

DATATYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "UINT8",
    torch.int8: "INT8",
    torch.int16: "INT16",
    torch.int32: "INT32",
    torch.int64: "INT64",
    torch.float16: "FP16",
    torch.float32: "FP32",
    torch.float64: "FP64",
    torch.bfloat16: "FP32",  # the protocol (and kserve) has no BF16: sent and answered as FP32
}
"""Torch dtypes as the Open Inference Protocol's datatypes."""


def datatype(dtype: torch.dtype) -> str:
    """The protocol's name for ``dtype``."""
    try:
        return DATATYPES[dtype]
    except KeyError:
        raise ValueError(f"the Open Inference Protocol has no datatype for {dtype}") from None


NUMPY_DATATYPES: dict[numpy.dtype[Any], str] = {
    numpy.dtype(str(dtype).removeprefix("torch.")): name for dtype, name in DATATYPES.items() if dtype != torch.bfloat16
}
"""The same, for the numpy arrays an answer is sent as (bfloat16 is widened before: numpy has none)."""


def input_datatype(spec: InputSpec) -> str:
    """The protocol's datatype of an input; FP32 for the metadata when no tuned graph names it (any passes)."""
    return "FP32" if spec.dtype is None else datatype(spec.dtype)


def input_metadata(spec: InputSpec) -> dict[str, Any]:
    """The protocol's tensor metadata of an input: name, datatype and shape (-1 where it varies)."""
    return {"name": spec.name, "datatype": input_datatype(spec), "shape": list(spec.shape or [-1])}


@attrs.frozen
class OutputSpec:
    """One named output tensor, as the metadata lists it."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def output_specs(model: torch.nn.Module, outputs: Mapping[str, torch.Tensor]) -> dict[str, OutputSpec]:
    """Each output of a warm-up call: its name, datatype, and shape with -1 on axis 0 (the batch, which
    the server splits outputs on) and, where the model itself was tuned, on the axes its graph records
    as dynamic."""
    graph = model_graph(model) if isinstance(model, ait.Module) else None  # a submodule's outputs are not the model's
    recorded = list(graph.outputs) if graph is not None else []
    specs = {}
    for i, (name, tensor) in enumerate(outputs.items()):
        dims: Sequence[Any] = recorded[i].dims if len(recorded) == len(outputs) else [None] * tensor.dim()
        shape = tuple(
            -1 if axis == 0 or (axis < len(dims) and dims[axis] is not None) else size
            for axis, size in enumerate(tensor.shape)
        )
        specs[name] = OutputSpec(name, datatype(tensor.dtype), shape)
    return specs
