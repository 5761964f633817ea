"""Where ONNX Runtime placed the graph's nodes: a GPU session whose compute nodes run on the CPU is refused.

A GPU provider leaves some nodes to the CPU provider on purpose (the CUDA provider keeps shape
arithmetic such as Shape -> Gather -> Concat -> Reshape on the CPU), so a CPU provider beside it
is normal and ``session.disable_cpu_ep_fallback`` would refuse ordinary dynamic-shape exports.
What must not run on the CPU is the work: matrix products, convolutions and attention. Two
records of the placement are read, whichever the installed ONNX Runtime has:

- ``session.get_provider_graph_assignment_info()`` (ONNX Runtime 1.24 and later, with the session
  config entry :data:`RECORD_KEY`): subgraphs, each with ``ep_name`` and nodes (``name``,
  ``op_type``, ``domain``), taken after basic optimisations;
- before that, the profile of one run (``SessionOptions.enable_profiling``): a JSON list of trace
  events where each node run is ``{"cat": "Node", "name": "<node>_kernel_time", "args":
  {"op_name": ..., "provider": ...}}``, taken after every optimisation (fused nodes included).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

RECORD_KEY = "session.record_ep_graph_assignment_info"
CPU_PROVIDER = "CPUExecutionProvider"
COMPUTE_OPS = frozenset(
    {
        "MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "LSTM", "GRU", "RNN",
        "Attention", "MultiHeadAttention", "GroupQueryAttention",
        "FusedConv", "FusedMatMul", "FusedGemm", "MatMulNBits", "MatMulInteger", "ConvInteger",
        "QLinearMatMul", "QLinearConv", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QAttention",
    }
)  # fmt: skip
"""Operator types that carry a model's arithmetic (ONNX's, recurrent layers and ``Einsum``, which
the exporters emit for attention scores, included; and com.microsoft's fused and quantized forms): on the CPU they are the fallback that makes a GPU candidate slow, not bookkeeping."""


def records_assignment(session_class: Any) -> bool:
    """Whether this ONNX Runtime reports node placement without a run (1.24 and later)."""
    return hasattr(session_class, "get_provider_graph_assignment_info")


def cpu_compute_from_assignment(subgraphs: Iterable[Any]) -> list[tuple[str, str]]:
    """(node name, op type) of every compute node the assignment gives the CPU provider."""
    found = []
    for subgraph in subgraphs:
        if subgraph.ep_name != CPU_PROVIDER:
            continue
        found += [(node.name, node.op_type) for node in subgraph.get_nodes() if node.op_type in COMPUTE_OPS]
    return found


def cpu_compute_from_profile(events: Any) -> list[tuple[str, str]]:
    """(node name, op type) of every compute node a profile shows running on the CPU provider, once each."""
    found: dict[str, str] = {}
    for event in events if isinstance(events, list) else []:
        if not isinstance(event, dict) or event.get("cat") != "Node":
            continue
        args = event.get("args")
        if not isinstance(args, dict) or args.get("provider") != CPU_PROVIDER:
            continue  # fence events carry op_name but no provider
        op, name = args.get("op_name"), str(event.get("name", ""))
        if op in COMPUTE_OPS:
            found.setdefault(name.removesuffix("_kernel_time"), str(op))
    return list(found.items())


def read_profile(path: str | Path) -> list[tuple[str, str]]:
    """The CPU compute nodes of a profile file ONNX Runtime wrote; the file is removed afterwards."""
    file = Path(path)
    try:
        events = json.loads(file.read_text(encoding="utf-8"))
    finally:
        file.unlink(missing_ok=True)
    return cpu_compute_from_profile(events)


def fallback_error(nodes: list[tuple[str, str]], provider: str, source: str) -> str | None:
    """The build error for compute nodes left to the CPU, or None when there are none."""
    if not nodes:
        return None
    shown = ", ".join(f"{name} ({op})" for name, op in nodes[:8])
    more = f" and {len(nodes) - 8} more" if len(nodes) > 8 else ""
    return (
        f"ONNX Runtime placed {len(nodes)} compute node(s) on the CPU instead of the {provider} ({source}): "
        f"{shown}{more}; this candidate would measure a CPU fallback. The provider cannot run those "
        "operators with these types or shapes: try the other exporter, another opset or dtype, or another backend"
    )
