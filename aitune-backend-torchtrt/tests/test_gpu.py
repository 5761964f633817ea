"""Real Torch-TensorRT compile, inference, save and load: needs a CUDA GPU and torch-tensorrt."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from aitune import tree
from aitune.backend import Backend, BuildContext, LoadContext
from aitune.testing import assert_matches_eager
from aitune.validation import validate
from aitune_backend_torchtrt.archive import check_pt2_archive
from aitune_backend_torchtrt.backend import PROGRAM_FILE, TorchTensorRTAotBackend, TorchTensorRTJitBackend
from aitune_backend_torchtrt.config import (
    TorchTensorRTAotBackendConfig,
    TorchTensorRTConfig,
    TorchTensorRTJitBackendConfig,
)
from aitune_backend_torchtrt.versions import runtime_problem

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(runtime_problem() is not None, reason=f"Torch-TensorRT unusable: {runtime_problem()}"),
]

FP16 = TorchTensorRTConfig(enabled_precisions=("fp16", "fp32"), min_block_size=1)
BACKENDS = [
    TorchTensorRTJitBackend(TorchTensorRTJitBackendConfig(compile_config=TorchTensorRTConfig(min_block_size=1))),
    TorchTensorRTJitBackend(TorchTensorRTJitBackendConfig(compile_config=FP16)),
    TorchTensorRTAotBackend(TorchTensorRTAotBackendConfig(compile_config=TorchTensorRTConfig(min_block_size=1))),
    TorchTensorRTAotBackend(TorchTensorRTAotBackendConfig(compile_config=FP16)),
]


@pytest.mark.parametrize(
    "template", BACKENDS, ids=lambda b: f"{b.name}-{'-'.join(b.config.compile_config.enabled_precisions)}"
)
def test_compile_validate_save_load(template: Backend, tmp_path: Path, encoder, make_samples, make_graph) -> None:
    module = copy.deepcopy(encoder).to("cuda")  # the shared CPU fixture stays on the CPU
    samples = make_samples(device="cuda")
    graph = make_graph(module, samples)
    context = BuildContext(graph, samples, torch.device("cuda"), tmp_path / "work", tmp_path / "cache")
    context.workdir.mkdir()
    built = template.clone()
    built.build(module, context)
    report = validate(built, module, samples, graph)
    assert report.passed, report.reason

    payload = tmp_path / "payload"
    payload.mkdir()
    metadata = built.save(payload)
    if isinstance(built, TorchTensorRTAotBackend):
        check_pt2_archive((payload / PROGRAM_FILE).read_bytes())
    loaded = template.clone()
    loaded.load(module, payload, LoadContext(graph, torch.device("cuda"), metadata, tmp_path / "cache"))
    assert loaded.build_info["load_compiles"] is isinstance(loaded, TorchTensorRTJitBackend)
    for sample in samples:
        want = tree.flatten(built.infer(*sample.args, **sample.kwargs))[0]
        got = tree.flatten(loaded.infer(*sample.args, **sample.kwargs))[0]
        for w, g in zip(want, got):
            assert_matches_eager(g, w)


def test_isolated_aot_build_compiles_in_a_worker(tmp_path: Path, encoder, make_samples, make_graph) -> None:
    """export here, Torch-TensorRT in ``python -m aitune.builds.worker`` from the exported file alone, load here."""
    from aitune.executor import run_worker

    module = copy.deepcopy(encoder).to("cuda")
    samples = make_samples(device="cuda")
    graph = make_graph(module, samples)
    context = BuildContext(graph, samples, torch.device("cuda"), tmp_path, tmp_path / "cache")
    backend = TorchTensorRTAotBackend(
        TorchTensorRTAotBackendConfig(compile_config=TorchTensorRTConfig(min_block_size=1))
    )
    folder = tmp_path / "isolated"
    (folder / "exported").mkdir(parents=True)
    notes = backend.export(module, context, folder / "exported")
    metadata = run_worker(backend, notes, context, folder)
    assert [p.name for p in (folder / "payload").iterdir()] == [PROGRAM_FILE]
    check_pt2_archive((folder / "payload" / PROGRAM_FILE).read_bytes())
    assert metadata["build"]["tensorrt_subgraphs"] >= 1
    backend.load(module, folder / "payload", LoadContext(graph, torch.device("cuda"), metadata, tmp_path / "cache"))
    assert backend.build_info["load_compiles"] is False
    report = validate(backend, module, samples, graph)
    assert report.passed, report.reason


def test_an_fp16_config_builds_an_fp16_engine_and_fp32_stays_fp32(tmp_path: Path) -> None:
    """Releases that dropped ``enabled_precisions`` would build fp32 for an fp16 config: the error tells."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)).eval().cuda()
    from aitune.graph import Sample, infer_graph

    samples = [Sample((torch.randn(b, 512, device="cuda"),)) for b in (4, 8)]
    with torch.no_grad():
        graph = infer_graph(samples, ["x"], outputs=[module(*s.args) for s in samples])
    errors = {}
    for name, config in {"fp32": TorchTensorRTConfig(min_block_size=1), "fp16": FP16}.items():
        context = BuildContext(graph, samples, torch.device("cuda"), tmp_path / name, tmp_path / "cache")
        context.workdir.mkdir()
        backend = TorchTensorRTAotBackend(TorchTensorRTAotBackendConfig(compile_config=config))
        backend.build(module, context)
        with torch.no_grad():
            errors[name] = float((backend.infer(*samples[1].args) - module(*samples[1].args)).abs().max())
        assert backend.build_info["tensorrt_subgraphs"] >= 1
        note = backend.build_info.get("autocast_calibration")
        if name == "fp16" and note is not None:  # 2.13+: autocast measured the recorded calls
            assert note.startswith(("1 recorded", "none: this Torch-TensorRT release")), note
    assert errors["fp32"] < 1e-4, f"fp32 without TF32: {errors}"
    assert errors["fp16"] > 1e-4, f"an fp16 engine rounds visibly more than fp32: {errors}"
