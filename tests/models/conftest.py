"""Real architectures from small configs (random weights, nothing downloaded) and the round trip
every test of this layer runs: eager reference -> wrap -> tune -> run -> save -> load in a fresh object.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import aitune.torch as ait
from aitune import tree
from aitune.engine.module import wrapped_modules
from aitune.plugins import get_manager
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=20, warmup=2, window=5), extend_s=0.0
)
ATOL, RTOL = 1e-4, 1e-3
"""Against the scale of each output (as aitune's float32 bound); loose enough for any x86 CPU."""


def backends(*names: str) -> list[Any]:
    """The named backends that can run here (each test names what it sweeps)."""
    registry = get_manager().registry
    usable = [n for n in names if n in registry and not registry.status(n).reason("cpu")]
    if not usable:
        pytest.skip(f"none of {names} can run here")
    return [registry.backend_class(n)() for n in usable]


def strategy(*names: str) -> ait.TuneStrategy:
    return ait.MaxThroughputStrategy(backends=backends(*names), profiling_config=QUICK)


def assert_same(actual: Any, expected: Any, what: str) -> None:
    """Same type all the way down, and every tensor within the bound."""
    assert type(actual) is type(expected), f"{what}: {type(actual).__name__}, eager {type(expected).__name__}"
    got, got_structure = tree.flatten(actual)
    want, want_structure = tree.flatten(expected)
    assert got_structure == want_structure, f"{what}: output structure differs from eager"
    for i, (a, e) in enumerate(zip(got, want)):
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: output {i} is {a.shape} {a.dtype}"
        scale = float(e.abs().max()) if e.numel() else 0.0
        err = float((a.double() - e.double()).abs().max()) if e.numel() else 0.0
        assert err <= ATOL + RTOL * scale, f"{what}: output {i} is off by {err:.3g} (scale {scale:.3g})"


def round_trip(
    build: Callable[[], Any],
    wrap: Callable[[Any], Any],
    call: Callable[[Any, Any], Any],
    data: Sequence[Any],
    unseen: Sequence[Any],
    tmp_path: Path,
    must_pass: Sequence[str] = ("onnxruntime",),
) -> Any:
    """The whole user path on one model; returns the tune report.

    ``build`` makes the model from a fixed seed; ``wrap`` wraps its modules and returns what to
    call from then on (the model, or its ``ait.Module`` when wrapped whole); ``call`` runs the model (or pipeline) on one dataset item. Asserts every output keeps its
    eager type and values (recorded items and unseen in-range shapes), that each backend in
    ``must_pass`` built and matched eager, that a non-eager backend was chosen or the report says
    why not, and that the artifact loaded into a freshly built model gives the same outputs.
    """
    torch.manual_seed(0)
    model = build()
    with torch.no_grad():
        reference = [call(model, item) for item in [*data, *unseen]]
    model = wrap(model)
    wrapped = wrapped_modules(model)
    report = ait.tune(model, data)
    for module in report.modules:
        assert module.status != "failed", f"{module.name}: {module.error}"
        for graph in module.graphs:
            assert graph.decision != "torch_eager" or graph.reason, f"{module.name}: eager without a reason"
            for name in must_pass:  # a backend with several variants passes when one of them does
                tried = [c for c in graph.candidates if c.backend == name]
                reasons = "; ".join(f"{c.variant or 'default'}: {c.reason}" for c in tried)
                built = [c for c in tried if c.status not in ("failed", "not applicable", "skipped")]
                assert not tried or built, f"{module.name}: {name}: {reasons}"
    assert {m.name for m in report.modules} == {m.name for m in wrapped}, "every wrapped module was called"
    with torch.no_grad():
        for i, (item, expected) in enumerate(zip([*data, *unseen], reference)):
            assert_same(call(model, item), expected, f"tuned, item {i}")
    path = ait.save(model, tmp_path / "model.ait")
    torch.manual_seed(0)  # the same weights, as from_pretrained would give (an artifact holds only wrapped modules)
    from aitune.artifact.archive import file_sha256

    fresh = ait.load(wrap(build()), path, expected_sha256=file_sha256(path))  # pinned: native payloads may run
    with torch.no_grad():
        for i, (item, expected) in enumerate(zip([*data, *unseen], reference)):
            assert_same(call(fresh, item), expected, f"loaded, item {i}")
    return report


def chosen(report: Any) -> list[str]:
    return [g.decision for m in report.modules for g in m.graphs]


@pytest.fixture
def flow() -> Any:
    """This layer's helpers (test modules import nothing from conftest under importlib mode)."""
    return SimpleNamespace(
        round_trip=round_trip, strategy=strategy, chosen=chosen, token_batches=token_batches, assert_same=assert_same
    )


def token_batches(sizes: Sequence[tuple[int, int]], vocab: int = 100, seed: int = 0, padded: bool = True) -> list[dict]:
    """``input_ids`` and an ``attention_mask`` per (batch, sequence); padding varies by row."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for batch, seq in sizes:
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        if padded:  # every batch padded (an all-ones mask would be dropped by the model: another graph)
            for row in range(batch):
                mask[row, seq - 1 - row % (seq // 2) :] = 0
        items.append({"input_ids": ids, "attention_mask": mask})
    return items
