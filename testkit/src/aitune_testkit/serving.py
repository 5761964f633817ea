"""A tiny model to serve in tests and the serving benchmark, importable by name in every Ray worker
(``aitune_testkit.serving:build``), the artifact tuned from it, and what the engines' tests send
(malformed bodies, Triton client inputs)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FEATURES = 16
LENGTH = 8
"""The sequence length it is tuned for (static): another length runs eager, and says why."""
BATCH_SIZES = (2, 4)
"""The batch sizes it is tuned for: batches of 2 to 4 rows."""


class TinyEncoder(torch.nn.Module):
    """``x: [batch, length, 16]`` to ``[batch, 4]``: a projection, GELU, mean over the length, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(FEATURES, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.gelu(self.proj(x)).mean(dim=1))


class TwoHeads(TinyEncoder):
    """The same encoder answering two named outputs, ``{"logits": [batch, 4], "pooled": [batch, 32]}``,
    so a client can select one."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]  # a dict, on purpose
        pooled = torch.nn.functional.gelu(self.proj(x)).mean(dim=1)
        return {"logits": self.head(pooled), "pooled": pooled}


SLOW_S = 2.0
"""How long each call of :class:`SlowTwoHeads` takes: a request stays in flight long enough to stop
the server while it runs."""


class SlowTwoHeads(TwoHeads):
    """:class:`TwoHeads`, each call taking :data:`SLOW_S` (served ``--eager``, so it is this forward)."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]  # TwoHeads' dict
        import time

        time.sleep(SLOW_S)
        return super().forward(x)


def build_slow_two_heads() -> torch.nn.Module:
    """:class:`SlowTwoHeads`' factory."""
    return SlowTwoHeads().eval()


def build() -> torch.nn.Module:
    """The factory a deployment calls: the model freshly built, as ``ait.load`` takes it."""
    return TinyEncoder().eval()


def build_two_heads() -> torch.nn.Module:
    """:class:`TwoHeads`' factory."""
    return TwoHeads().eval()


def tune(path: str | Path, backend: str = "onnxruntime", factory: Callable[[], torch.nn.Module] = build) -> Path:
    """Tune ``factory()``'s model (:func:`build`'s by default) with one backend (no timing race: the
    first that validates wins) for batches of 2 to 4 rows of length 8, and save it to ``path``."""
    import aitune.torch as ait
    from aitune.plugins import get_manager

    model = ait.Module(
        factory(),
        "encoder",
        strategy=ait.FirstWinsStrategy([get_manager().registry.backend_class(backend)()], performance_validation=False),
    )
    g = torch.Generator().manual_seed(1)
    ait.tune(model, [torch.randn(b, LENGTH, FEATURES, generator=g) for b in BATCH_SIZES])
    ait.save(model, path)
    return Path(path)


MALFORMED_BODIES: dict[str, tuple[bytes, dict[str, str]]] = {
    "not-json": (b"{not json", {"Content-Type": "application/json"}),
    "too-few-values": (b'{"inputs": [{"name": "x", "shape": [2, 8, 16], "datatype": "FP32", "data": [1, 2]}]}', {}),
    "truncated-binary": (
        b'{"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}]}abc',
        {"Inference-Header-Content-Length": "94"},
    ),
    "inputs-not-objects": (b'{"inputs": [3]}', {"Inference-Header-Content-Length": "15"}),
    "nested-100k-deep": (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {"Content-Type": "application/json"}),
    "past-uint64": (
        b'{"inputs": [{"name": "x", "shape": [1, 1, 2], "datatype": "FP32", "data": [18446744073709551616, 1]}]}',
        {"Content-Type": "application/json"},
    ),
    "nan-literal": (
        b'{"inputs": [{"name": "x", "shape": [1, 1, 2], "datatype": "FP32", "data": [NaN, 1]}]}',
        {"Content-Type": "application/json"},
    ),
    "header-declares-64-tib": (
        b'{"inputs": [{"name": "x", "shape": [1099511627776, 8, 16], "datatype": "FP32", '
        b'"parameters": {"binary_data_size": 70368744177664}}]}abcd',
        {"Inference-Header-Content-Length": "132"},
    ),
}
"""Open Inference Protocol bodies for the ``x`` input of :func:`build_two_heads` that a client gets
wrong, by id: each engine must answer every one with a 4xx and a body saying what was wrong, never
a 500 (the last four were 500s when issue 52 was filed)."""


def triton_inputs(arrays: dict[str, Any]) -> list[Any]:
    """Triton's HTTP client's inputs for named numpy arrays, as binary tensors of their own datatype."""
    import tritonclient.http as httpclient  # type: ignore[import-not-found]  # a test extra, not in typecheck's venv
    from tritonclient.utils import np_to_triton_dtype  # type: ignore[import-not-found]

    inputs = []
    for name, array in arrays.items():
        tensor = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array, binary_data=True)
        inputs.append(tensor)
    return inputs
