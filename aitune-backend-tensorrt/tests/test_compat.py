"""Whether a saved plan can run on a machine, decided from metadata before TensorRT parses it."""

from __future__ import annotations

from pathlib import Path

import pytest

from aitune.errors import ArtifactError, BackendUnavailableError
from aitune_backend_tensorrt import compat
from aitune_backend_tensorrt.compat import Machine, check_compatible, version_tuple
from aitune_backend_tensorrt.engine import timing_cache_path

SAVED = {
    "tensorrt_version": "10.9.0.34",
    "gpu_name": "NVIDIA A100-SXM4-80GB",
    "compute_capability": [8, 0],
    "hardware_compatible": False,
    "version_compatible": False,
}
A100 = Machine(tensorrt_version="10.9.0.34", cuda=True, gpu_name="NVIDIA A100-SXM4-40GB", compute_capability=(8, 0))


def test_same_release_and_compute_capability_is_compatible():
    check_compatible(SAVED, A100)
    check_compatible(SAVED, Machine("10.9.0.1", True, "NVIDIA A100", (8, 0)))  # build number differs only


@pytest.mark.parametrize(
    ("here", "error", "message"),
    [
        (Machine("10.9.0.34", cuda=False), BackendUnavailableError, "no CUDA device"),
        (Machine(None, True, "NVIDIA A100", (8, 0)), BackendUnavailableError, "not installed"),
        (Machine("11.0.0", True, "NVIDIA A100", (8, 0)), ArtifactError, "do not cross major versions"),
        (Machine("10.12.0", True, "NVIDIA A100", (8, 0)), ArtifactError, "runs only on that release"),
        (Machine("10.9.0", True, "NVIDIA H100", (9, 0)), ArtifactError, r"compute capability 9\.0"),
    ],
)
def test_incompatible_machines_are_refused_with_what_to_do(here, error, message):
    with pytest.raises(error, match=message) as info:
        check_compatible(SAVED, here)
    assert "ait.tune" in str(info.value) or "install" in str(info.value) or "GPU" in str(info.value)


def test_version_compatible_plans_run_on_later_releases_of_the_same_major():
    saved = {**SAVED, "version_compatible": True}
    check_compatible(saved, Machine("10.12.0", True, "NVIDIA A100", (8, 0)))
    with pytest.raises(ArtifactError, match=r"or a later 10\.x"):
        check_compatible(saved, Machine("10.3.0", True, "NVIDIA A100", (8, 0)))
    with pytest.raises(ArtifactError, match="major"):
        check_compatible(saved, Machine("11.0.0", True, "NVIDIA A100", (8, 0)))


def test_hardware_compatible_plans_run_on_ampere_and_later_only():
    saved = {**SAVED, "hardware_compatible": True}
    check_compatible(saved, Machine("10.9.0", True, "NVIDIA H100", (9, 0)))
    check_compatible(saved, Machine("10.9.0", True, "NVIDIA RTX A6000", (8, 6)))
    with pytest.raises(ArtifactError, match="Ampere or newer"):
        check_compatible(saved, Machine("10.9.0", True, "Tesla T4", (7, 5)))


def test_version_tuple_reads_the_release_part():
    assert version_tuple("10.9.0.34") == (10, 9, 0)
    assert version_tuple("10.13.0.post12") == (10, 13, 0)
    assert version_tuple("11.0") == (11, 0)


def test_timing_cache_is_one_file_per_release_and_compute_capability(tmp_path: Path):
    a = timing_cache_path(tmp_path, A100)
    assert a == tmp_path / "tensorrt" / "timing-cache-trt10.9.0.34-sm80.bin"
    assert timing_cache_path(tmp_path, Machine("10.9.0.34", True, "H100", (9, 0))) != a


def test_availability_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(compat, "installed_tensorrt", lambda: (False, None))
    monkeypatch.setattr(compat, "cuda_reason", lambda: None)
    monkeypatch.setattr(compat, "torch_cuda_major", lambda: 12)
    assert "TensorRT is not installed" in compat.availability_reason("cuda")
    assert "aitune-backend-tensorrt[runtime,cu12]" in compat.availability_reason("cuda"), "the extra for torch's CUDA"

    monkeypatch.setattr(compat, "installed_tensorrt", lambda: (True, "10.9.0"))
    monkeypatch.setattr(compat, "cuda_reason", lambda: "no CUDA device is visible to torch")
    assert compat.availability_reason("cuda") == "no CUDA device is visible to torch"

    monkeypatch.setattr(compat, "installed_tensorrt", lambda: (True, "8.6.1"))
    assert "needs TensorRT >= 10" in compat.availability_reason("cuda")

    monkeypatch.setattr(compat, "installed_tensorrt", lambda: (True, "10.9.0"))
    monkeypatch.setattr(compat, "cuda_reason", lambda: None)
    assert compat.availability_reason("cuda") is None
    assert "CUDA devices only" in compat.availability_reason("cpu")


def test_installed_tensorrt_reads_any_tensorrt_distribution(monkeypatch):
    pretend_installed(monkeypatch, {"tensorrt-cu12": "10.9.0.34"})
    assert compat.installed_tensorrt() == (True, "10.9.0.34")
    pretend_installed(monkeypatch, {})
    monkeypatch.setattr(compat.importlib.util, "find_spec", lambda name: None)
    assert compat.installed_tensorrt() == (False, None)


def _requirements(extra: str | None = None) -> dict[str, object]:
    """The installed distribution's requirements by name (its metadata; no runtime is imported)."""
    import importlib.metadata

    from packaging.requirements import Requirement

    out = {}
    for line in importlib.metadata.requires("aitune-backend-tensorrt") or []:
        req = Requirement(line)
        in_extra = req.marker is not None and "extra" in str(req.marker)
        if (extra is None and not in_extra) or (in_extra and req.marker.evaluate({"extra": extra or ""})):
            out[req.name] = req
    return out


def test_declared_floors_match_the_apis_the_code_calls():
    base = _requirements()
    modelopt = base["nvidia-modelopt"]
    assert not modelopt.specifier.contains("0.43.0") and modelopt.specifier.contains("0.44.0")
    assert ".".join(map(str, compat.MIN_MODELOPT)) == "0.44"
    trt12, trt13 = _requirements("cu12")["tensorrt-cu12"], _requirements("cu13")["tensorrt-cu13"]
    for version, ok in (("9.3.0", False), ("10.0.1", True), ("11.4.0", True), ("12.0.0", False)):
        assert trt12.specifier.contains(version) is ok, version
        assert (compat.version_reason(version, None, None) is None) is ok, version
    assert trt13.specifier.contains("10.13.0") and not trt13.specifier.contains(
        "10.9.0"
    )  # CUDA 13 builds start at 10.13
    # no TensorRT without an extra: a default one would put one CUDA build beside a torch of the other
    assert not {"tensorrt", "tensorrt-cu12", "tensorrt-cu13"} & set(base)
    assert "tensorrt-cu13" not in _requirements("cu12") and "tensorrt-cu12" not in _requirements("cu13")
    assert _requirements("test")["nvidia-modelopt"].specifier.contains("0.43.0") is False


def test_the_install_hint_names_the_extra_for_torchs_cuda(monkeypatch):
    assert compat.install_hint(12) == "pip install 'aitune-backend-tensorrt[runtime,cu12]'"
    assert compat.install_hint(13) == "pip install 'aitune-backend-tensorrt[runtime,cu13]'"
    monkeypatch.setattr(compat, "torch_cuda_major", lambda: None)
    assert compat.install_hint() == compat.INSTALL_HINT, "a CPU torch: PyPI's CUDA 13"


def pretend_installed(monkeypatch, installed: dict[str, str]) -> None:
    """Package metadata that lists exactly ``installed`` (name -> version)."""
    import importlib.metadata

    def version(name: str) -> str:
        if name in installed:
            return installed[name]
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(compat.importlib.metadata, "version", version)


def test_two_tensorrt_frontends_are_refused_with_the_one_to_keep(monkeypatch):
    pretend_installed(monkeypatch, {"tensorrt-cu12": "10.9.0.34", "tensorrt-cu13": "10.13.0.35"})
    monkeypatch.setattr(compat, "torch_cuda_major", lambda: 13)
    reason = compat.runtime_reason()
    assert "both installed and write one `tensorrt` package" in reason and "keep tensorrt-cu13" in reason


def test_the_machine_reports_the_version_that_imports_not_the_first_distribution(monkeypatch):
    """A plan records ``trt.__version__``; comparing it with another distribution's version would
    refuse a plan that runs (a false ArtifactError)."""
    monkeypatch.setattr(compat, "installed_tensorrt", lambda: (True, "10.9.0.34"))
    compat._importable_version.cache_clear()
    monkeypatch.setattr(compat, "tensorrt_version_in_subprocess", lambda: "10.13.0.35")
    try:
        assert compat.this_machine().tensorrt_version == "10.13.0.35"
        compat._importable_version.cache_clear()
        monkeypatch.setattr(compat, "tensorrt_version_in_subprocess", lambda: None)
        assert compat.this_machine().tensorrt_version == "10.9.0.34", "metadata when the child cannot say"
    finally:
        compat._importable_version.cache_clear()


def test_versions_outside_the_tested_range_are_reported_with_the_fix():
    assert "needs TensorRT >= 10" in compat.version_reason("8.6.1", 12, 12)
    too_new = compat.version_reason("12.0.0", 12, 12)
    assert "tested with TensorRT 10.x to 11.x" in too_new and "tensorrt-cu12>=10,<12" in too_new
    mismatch = compat.version_reason("11.1.0", 13, 12)
    assert "CUDA 13 build" in mismatch and "CUDA 12" in mismatch and "pip install 'tensorrt-cu12" in mismatch
    assert compat.version_reason("10.9.0", 12, None) is None  # a CPU torch: nothing to compare with
    assert "nvidia-modelopt 0.39.0 is installed" in compat.modelopt_reason("0.39.0")
    assert compat.modelopt_reason("0.44.0") is None and compat.modelopt_reason(None) is None


def test_the_cuda_build_of_tensorrt_is_read_from_its_distribution_name(monkeypatch):
    pretend_installed(monkeypatch, {"tensorrt": "11.1.0", "tensorrt-cu13": "11.1.0"})
    assert compat.tensorrt_cuda_major() == 13
    monkeypatch.setattr(compat, "torch_cuda_major", lambda: 12)
    assert "CUDA 13 build" in compat.runtime_reason()


def test_an_old_modelopt_is_refused_before_it_is_imported(monkeypatch):
    from aitune.errors import BackendUnavailableError
    from aitune_backend_tensorrt import precision

    monkeypatch.setattr(compat, "installed_modelopt", lambda: "0.33.1")
    with pytest.raises(BackendUnavailableError, match=r"nvidia-modelopt 0\.33\.1 .* >= 0\.44"):
        precision._modelopt("modelopt.onnx.quantization")
