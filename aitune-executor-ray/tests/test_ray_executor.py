"""The Ray executor on a local Ray instance (2 CPUs, shared by this module's tests)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from aitune_testkit import faults, ray_faults
from aitune_testkit.doubles import SlowModule
from aitune_testkit.faults import IsolatedToyBackend, RaisingBackend, SegfaultBackend

import aitune.torch as ait
from aitune.errors import ConfigError
from aitune.testing import assert_matches_eager
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig
from aitune_executor_ray import task
from aitune_executor_ray.executor import RayExecutor, shared_dir, task_resources

ray = pytest.importorskip("ray")
QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5), extend_s=0.0
)


@pytest.fixture(scope="module")
def ray_cluster():
    # Ray refuses a temp dir inside a virtualenv, where nox points TMPDIR, and its socket paths must
    # stay short: a folder of its own under /tmp
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def backends(ray_cluster, toy_backends, register_plugin):
    register_plugin(faults, name="aitune_testkit.faults", distribution="aitune-testkit")
    register_plugin(ray_faults, name="aitune_testkit.ray_faults", distribution="aitune-testkit")


class Pipeline(torch.nn.Module):
    """Two modules over three CPU backends: AOTInductor (real), an isolated toy and an in-process toy."""

    def __init__(self) -> None:
        super().__init__()
        from aitune.torch.backend import TorchInductorAotBackend

        encoder = [
            TorchInductorAotBackend(),
            IsolatedToyBackend(ToyConfig(speed=0.5)),
            ToyBackend(ToyConfig(speed=0.8)),
        ]
        head = [IsolatedToyBackend(ToyConfig(speed=0.3)), ToyBackend(ToyConfig(speed=0.6)), RaisingBackend()]
        self.encoder = ait.Module(SlowModule(), "encoder", strategy=ait.MaxThroughputStrategy(encoder, QUICK))
        self.head = ait.Module(SlowModule(), "head", strategy=ait.MaxThroughputStrategy(head, QUICK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _decisions(report):
    return [[(g.decision, [(c.backend, c.status) for c in g.candidates]) for g in m.graphs] for m in report.modules]


def test_ray_decides_as_the_local_executor_and_builds_on_ray(backends, aitune_cache_dir):
    """Ray builds first into a fresh build cache; the local tune then reuses those payloads (one
    AOTInductor compile instead of two, for CI time) and must reach the same decisions."""
    pytest.importorskip("aitune_backend_inductor")
    data = [torch.randn(4, 8), torch.randn(4, 8)]  # one batch size: SlowModule's sleep cannot take a symbolic size
    model = Pipeline()
    report = ait.tune(model, data, executor="ray")
    local = ait.tune(Pipeline(), data, executor="local")
    assert _decisions(report) == _decisions(local)
    assert [m.graphs[0].decision for m in report.modules] == ["torch_inductor_aot", "toy_isolated"]
    by_name = {(m.name, c.backend): c for m in report.modules for c in m.graphs[0].candidates}
    aot = by_name["encoder", "torch_inductor_aot"].build_info
    assert aot["executor"] == "ray" and aot["built_ahead"] and aot["worker_s"] > 0
    assert by_name["head", "toy_isolated"].build_info["executor"] == "ray"
    assert "executor" not in by_name["head", "toy"].build_info, "an in-process backend builds locally"
    assert "rejected the graph on purpose" in by_name["head", "fault_raise"].reason
    reused = {(m.name, c.backend) for m in local.modules for c in m.graphs[0].candidates if c.from_cache}
    assert {("encoder", "torch_inductor_aot"), ("head", "toy_isolated")} <= reused
    x = torch.randn(4, 8)
    assert_matches_eager(model(x), model.head.module(model.encoder.module(x)))


def test_a_killed_ray_worker_is_retried_and_its_candidate_still_wins(backends, aitune_cache_dir):
    model = ait.Module(
        SlowModule(),
        "m",
        strategy=ait.OneBackendStrategy(ray_faults.KillsRayWorkerOnceBackend(), profiling_config=QUICK),
    )
    report = ait.tune(model, [torch.randn(2, 8)], executor="ray")
    candidate = report.modules[0].graphs[0].candidates[0]
    markers = list((aitune_cache_dir / "fault-kill-ray-worker-once").iterdir())
    assert len(markers) == 1, "the first attempt ran and killed its Ray worker"
    assert candidate.status == "selected" and candidate.build_info["executor"] == "ray", candidate.reason


def test_a_build_that_crashes_costs_its_candidate_not_the_tune(backends):
    model = ait.Module(SlowModule(), "m", strategy=ait.MaxThroughputStrategy([SegfaultBackend(), ToyBackend()], QUICK))
    report = ait.tune(model, [torch.randn(2, 8)], executor="ray")
    crashed, toy = report.modules[0].graphs[0].candidates
    assert crashed.status == "failed" and "SIGSEGV" in crashed.reason and "on Ray node" in crashed.reason
    assert toy.status == "selected"


def test_with_a_shared_folder_files_travel_by_path_not_through_the_object_store(backends, tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setenv("AITUNE_RAY_SHARED_DIR", str(shared))
    monkeypatch.setenv("AITUNE_BUILD_CACHE", "0")

    def no_bytes(folder):
        raise AssertionError("the files were packed for the object store")

    monkeypatch.setattr(task, "pack", no_bytes)
    model = ait.Module(SlowModule(), "m", strategy=ait.OneBackendStrategy(IsolatedToyBackend(), profiling_config=QUICK))
    report = ait.tune(model, [torch.randn(2, 8)], executor="ray")
    candidate = report.modules[0].graphs[0].candidates[0]
    assert candidate.status == "selected" and candidate.build_info["executor"] == "ray", candidate.reason
    assert not list(shared.iterdir()), "the shared build folder is removed once its payload is loaded"
    monkeypatch.setenv("AITUNE_RAY_SHARED_DIR", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="is not a folder"):
        shared_dir()


def test_aitune_backends_shows_the_ray_cluster(ray_cluster):
    from typer.testing import CliRunner

    from aitune.cli import app

    result = CliRunner().invoke(app, ["executors", "--json"])
    assert result.exit_code == 0, result.output
    ray_row = next(r for r in json.loads(result.output) if r["executor"] == "ray")
    assert ray_row["status"] == "available" and ray_row["resources"]["CPU"] == 2.0


def test_resources_follow_the_build_device(monkeypatch):
    assert task_resources("cuda:0", "accelerator_type:H100") == {
        "num_cpus": 1,
        "num_gpus": 1,
        "resources": {"accelerator_type:H100": 0.001},
    }
    assert task_resources("cpu", None) == {"num_cpus": 1.0, "num_gpus": 0}
    monkeypatch.setenv("AITUNE_RAY_BUILD_CPUS", "4")
    assert task_resources("cpu", None)["num_cpus"] == 4.0


def test_a_gpu_build_on_a_cluster_without_gpus_fails_its_candidate_at_once(ray_cluster):
    assert "no node has CPU: 1, GPU: 1" in RayExecutor._unschedulable(task_resources("cuda", None))
    assert RayExecutor._unschedulable(task_resources("cpu", None)) is None


def test_payload_files_travel_as_bytes_and_no_name_escapes_the_folder(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "engine.plan").write_bytes(b"\x00plan")
    files = task.pack(tmp_path / "a")
    assert files == {"b/engine.plan": b"\x00plan"}
    task.unpack(files, tmp_path / "copy")
    assert (tmp_path / "copy" / "b" / "engine.plan").read_bytes() == b"\x00plan"
    for bad in ("../evil", "/etc/passwd", "a/../../evil"):
        with pytest.raises(ValueError, match="not a plain relative path"):
            task.unpack({bad: b""}, tmp_path / "copy")
    assert not Path(tmp_path / "evil").exists()
