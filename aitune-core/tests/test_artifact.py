"""The .ait artifact: round trips, integrity, no pickle, compatibility, atomic saves, the build cache."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch
from aitune_testkit.doubles import SlowModule
from typer.testing import CliRunner

import aitune.torch as ait
from aitune.cli import app
from aitune.errors import ArtifactError, ArtifactIntegrityError, InputError
from aitune.testing import assert_matches_eager
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=10, warmup=1, window=5), extend_s=0.0
)
REGISTER_TOYS = (
    "import aitune.testing.backends as tb\n"
    "from aitune.plugins import get_manager\n"
    "get_manager().register(tb, name='aitune.testing.backends', distribution='aitune-core')\n"
)


def tuned(name="m", seed=0):
    torch.manual_seed(seed)
    model = ait.Module(
        SlowModule(), name, strategy=ait.OneBackendStrategy(ToyBackend(ToyConfig()), profiling_config=QUICK)
    )
    ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
    return model


def fresh(name="m"):
    torch.manual_seed(123)  # other weights than the saved ones: load must restore them
    return ait.Module(SlowModule(), name)


def rewrite(src: Path, dst: Path, change) -> None:
    """Copy an artifact, letting ``change(name, data)`` alter members, and fix up the digest list."""
    with zipfile.ZipFile(src) as zin:
        members = {n: zin.read(n) for n in zin.namelist() if n != "SHA256SUMS"}
    members = dict(change(members))
    sums = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in sorted(members.items()))
    with zipfile.ZipFile(dst, "w") as zout:
        for n, d in members.items():
            zout.writestr(n, d)
        zout.writestr("SHA256SUMS", sums)


@pytest.fixture
def artifact(toy_backends, tmp_path):
    model = tuned()
    path = ait.save(model, tmp_path / "model.ait")
    return model, path


def test_round_trip_restores_weights_and_the_tuned_backend(artifact):
    model, path = artifact
    loaded = ait.load(fresh(), path)
    assert loaded.state == "tuned"
    assert torch.equal(loaded.fc.weight, model.fc.weight)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert_matches_eager(loaded(x), model(x))
        [(graph, backend)] = loaded.tuned_graphs
        assert backend.calls > 0 and (graph.batch.min, graph.batch.max) == (2, 4)
        with pytest.warns(RuntimeWarning, match="outside what was tuned"):
            torch.testing.assert_close(loaded(torch.randn(16, 8)).shape, torch.Size([16, 8]))


def test_pipeline_of_several_modules_round_trips(toy_backends, tmp_path):
    pipe = {"encoder": tuned("encoder", 1), "decoder": tuned("decoder", 2)}
    path = ait.save(pipe, tmp_path / "pipe.ait")
    target = {"encoder": fresh("encoder"), "decoder": fresh("decoder")}
    ait.load(target, path)
    x = torch.randn(2, 8)
    assert_matches_eager(target["decoder"](target["encoder"](x)), pipe["decoder"](pipe["encoder"](x)))


def test_load_in_a_fresh_process(artifact, tmp_path):
    model, path = artifact
    x = torch.randn(3, 8)
    torch.save(x, tmp_path / "x.pt")
    code = REGISTER_TOYS + textwrap.dedent(
        f"""
        import json, torch, aitune.torch as ait
        from aitune_testkit.doubles import SlowModule
        m = ait.load(ait.Module(SlowModule(), "m"), {str(path)!r})
        y = m(torch.load({str(tmp_path / "x.pt")!r}, weights_only=True))
        print(json.dumps({{"state": m.state, "y": y.tolist()}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["state"] == "tuned"
    assert_matches_eager(torch.tensor(result["y"]), model(x))


def test_a_planted_pickle_is_refused_and_never_runs(artifact, tmp_path):
    _, path = artifact
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.ait"
    weights = "modules/0/weights.safetensors"
    rewrite(path, evil, lambda m: {**m, weights: pickle.dumps({"fc.weight": Exploit()})}.items())
    with pytest.raises(ArtifactError, match="weights of 'm' cannot be read"):
        ait.load(fresh(), evil)
    assert not marker.exists()


def test_a_flipped_byte_is_refused(artifact, tmp_path):
    _, path = artifact
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("modules/0/weights.safetensors")
    data[info.header_offset + 30 + len(info.filename) + 10] ^= 0xFF
    bad = tmp_path / "bad.ait"
    bad.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="does not match its SHA-256|cannot be read"):
        ait.load(fresh(), bad)


def test_a_local_header_that_moves_a_members_bytes_is_refused(artifact, tmp_path):
    """Members are read where their local header says their bytes start: a header whose extra-field
    length was changed points at other bytes, which fail the layout check or the member's SHA-256."""
    _, path = artifact
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("modules/0/weights.safetensors")
    at = info.header_offset + 28
    extra = int.from_bytes(data[at : at + 2], "little") + 2
    data[at : at + 2] = extra.to_bytes(2, "little")
    bad = tmp_path / "moved.ait"
    bad.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="overlaps the one before it") as refused:
        ait.load(fresh(), bad)
    assert "weights.safetensors" not in str(refused.value), "the member after it is the one overlapped"


def test_an_altered_payload_is_refused_even_with_fallback_eager(artifact, tmp_path):
    """fallback="eager" covers payloads that cannot run here, never bytes that were changed."""
    _, path = artifact
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("modules/0/graphs/0/toy.txt")
    data[info.header_offset + 30 + len(info.filename) + len(info.extra)] ^= 0x01
    bad = tmp_path / "bad.ait"
    bad.write_bytes(bytes(data))
    with pytest.raises(ArtifactIntegrityError, match="toy.txt"):
        ait.load(fresh(), bad, fallback="eager")


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_saved_artifact_has_the_mode_the_umask_gives(toy_backends, tmp_path, umask):
    model = tuned()
    previous = os.umask(umask)
    try:
        path = ait.save(model, tmp_path / "model.ait")
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_truncated_file_is_refused(artifact, tmp_path):
    _, path = artifact
    cut = tmp_path / "cut.ait"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ArtifactError, match="truncated or corrupt"):
        ait.load(fresh(), cut)


def test_member_paths_that_escape_are_refused(artifact, tmp_path):
    _, path = artifact
    evil = tmp_path / "escape.ait"
    rewrite(path, evil, lambda m: {**m, "../../etc/evil": b"x"}.items())
    with pytest.raises(ArtifactError, match="escapes the archive"):
        ait.load(fresh(), evil)
    assert not (tmp_path.parent.parent / "etc" / "evil").exists()


@pytest.mark.parametrize("alias", ["modules/0/graphs/0/./toy.txt", "modules/0/graphs/0//toy.txt"])
def test_member_names_that_alias_another_are_refused(artifact, tmp_path, alias):
    """``a/./b`` and ``a//b`` are distinct names that extract onto ``a/b``: the later one would win."""
    _, path = artifact
    evil = tmp_path / "alias.ait"
    rewrite(path, evil, lambda m: {**m, alias: b"0.5"}.items())
    with pytest.raises(ArtifactError, match="not written plainly"):
        ait.load(fresh(), evil, fallback="eager")


def test_unlisted_or_missing_members_are_refused(artifact, tmp_path):
    _, path = artifact
    data = path.read_bytes()
    sneaky = tmp_path / "sneaky.ait"
    sneaky.write_bytes(data)
    with zipfile.ZipFile(sneaky, "a") as z:
        z.writestr("extra.bin", b"unlisted")
    with pytest.raises(ArtifactError, match="does not match its digest list"):
        ait.load(fresh(), sneaky)


def test_unknown_format_version_is_refused(artifact, tmp_path):
    _, path = artifact

    def bump(members):
        manifest = json.loads(members["manifest.json"])
        manifest["format_version"] = 99
        return {**members, "manifest.json": json.dumps(manifest).encode()}.items()

    future = tmp_path / "future.ait"
    rewrite(path, future, bump)
    with pytest.raises(ArtifactError, match="format 99; this aitune reads format 1"):
        ait.load(fresh(), future)


def test_missing_plugin_names_the_distribution_to_install(artifact, tmp_path):
    _, path = artifact

    def rename(members):
        manifest = json.loads(members["manifest.json"])
        graph = manifest["modules"][0]["graphs"][0]
        graph.update(backend="warp_drive", distribution="aitune-backend-warp", distribution_version="3.1.4")
        graph["config"]["backend"] = "warp_drive"
        return {**members, "manifest.json": json.dumps(manifest).encode()}.items()

    other = tmp_path / "other.ait"
    rewrite(path, other, rename)
    with pytest.raises(ArtifactError, match=r"pip install 'aitune-backend-warp==3\.1\.4'"):
        ait.load(fresh(), other)
    with pytest.warns(RuntimeWarning, match="runs eager"):
        model = ait.load(fresh(), other, fallback="eager")
    assert model.state == "passthrough"
    assert_matches_eager(model(torch.ones(1, 8)), model.module(torch.ones(1, 8)))


def test_cuda_payload_on_a_cpu_machine(artifact, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _, path = artifact

    def to_cuda(members):
        manifest = json.loads(members["manifest.json"])
        for spec in manifest["modules"][0]["graphs"][0]["graph"]["inputs"]:
            spec["device"] = "cuda"
        return {**members, "manifest.json": json.dumps(manifest).encode()}.items()

    gpu = tmp_path / "gpu.ait"
    rewrite(path, gpu, to_cuda)
    with pytest.raises(ArtifactError, match="needs a CUDA device"):
        ait.load(fresh(), gpu)
    result = CliRunner().invoke(app, ["verify", str(gpu)])
    assert result.exit_code == 1 and "needs a CUDA device" in result.output


def test_expected_sha256_pins_the_file(artifact):
    _, path = artifact
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    ait.load(fresh(), path, expected_sha256=digest)
    with pytest.raises(ArtifactError, match="not the expected"):
        ait.load(fresh(), path, expected_sha256="0" * 64)


def test_wrong_architecture_and_missing_wrappers_are_explained(artifact):
    _, path = artifact
    with pytest.raises(
        ArtifactError, match=r"object has another structure .* fc.weight is \[4, 4\] here, \[8, 8\] saved"
    ):
        ait.load(ait.Module(SlowModule(features=4), "m"), path)
    with pytest.raises(
        ArtifactError, match="'m' was saved as the whole object, where the given object has ait.Module 'other'"
    ):
        ait.load(ait.Module(SlowModule(), "other"), path)


class TwoPart(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = SlowModule()
        self.head = torch.nn.Sequential(torch.nn.ReLU(), SlowModule())

    def forward(self, x):
        return self.head(self.encoder(x))


@pytest.fixture
def two_part(toy_backends, tmp_path):
    torch.manual_seed(0)
    model = TwoPart()
    strategy = ait.OneBackendStrategy(ToyBackend(ToyConfig()), profiling_config=QUICK)
    ait.wrap(model, ["encoder", "head.1"], strategy=strategy)
    ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
    return model, ait.save(model, tmp_path / "two.ait")


def test_load_wraps_a_freshly_built_model_at_the_saved_paths(two_part):
    model, path = two_part
    torch.manual_seed(5)
    built = TwoPart()
    assert ait.load(built, path) is built
    assert isinstance(built.encoder, ait.Module) and isinstance(built.head[1], ait.Module)
    assert (built.encoder.name, built.encoder.state, built.head[1].state) == ("encoder", "tuned", "tuned")
    x = torch.randn(3, 8)
    assert_matches_eager(built(x), model(x))


def test_load_fills_a_fresh_pipeline_by_attribute_name(toy_backends, tmp_path):
    class Pipe:
        def __init__(self):
            self.text_encoder, self.decoder, self.scale = SlowModule(), SlowModule(), 2.0

        def __call__(self, x):
            return self.decoder(self.text_encoder(x)) * self.scale

    pipe = Pipe()
    strategy = ait.OneBackendStrategy(ToyBackend(ToyConfig()), profiling_config=QUICK)
    pipe.text_encoder = ait.Module(pipe.text_encoder, "enc", strategy=strategy)
    pipe.decoder = ait.Module(pipe.decoder, "dec", strategy=strategy)
    ait.tune(pipe, [torch.randn(2, 8), torch.randn(4, 8)])
    path = ait.save(pipe, tmp_path / "pipe.ait")
    fresh_pipe = ait.load(Pipe(), path, device_map={"text_encoder": "cpu", "decoder": "cpu"})
    assert (fresh_pipe.text_encoder.name, fresh_pipe.decoder.name) == ("enc", "dec")
    x = torch.randn(3, 8)
    assert_matches_eager(fresh_pipe(x), pipe(x))


def test_load_refuses_an_object_that_differs_and_leaves_it_untouched(two_part):
    _, path = two_part

    class Renamed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.tail = SlowModule(), torch.nn.Sequential(torch.nn.ReLU(), SlowModule())

    built = Renamed()
    with pytest.raises(
        ArtifactError, match=r"'head.1' was saved at 'head.1', but cannot find 'head': Renamed has no 'head'"
    ):
        ait.load(built, path)
    assert not isinstance(built.encoder, ait.Module)  # nothing is wrapped when any part does not fit
    wider = TwoPart()
    wider.head[1] = SlowModule(features=8)
    wider.head[1].fc = torch.nn.Linear(8, 8, bias=False)
    with pytest.raises(ArtifactError, match=r"module at 'head.1' has another structure .*missing here: fc.bias"):
        ait.load(wider, path)


def test_integrity_is_checked_before_the_object(two_part, tmp_path):
    _, path = two_part
    bad = tmp_path / "bad.ait"
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        offset = z.getinfo("modules/1/weights.safetensors").header_offset + 100
    data[offset] ^= 0xFF  # one byte of the second module's weights
    bad.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="member 'modules/1/weights.safetensors'"):
        ait.load(object(), bad)  # an object with nothing to fill: the file is judged first


def test_device_map_entries_must_match_a_saved_module(two_part):
    _, path = two_part
    with pytest.raises(InputError, match=r"device_map names \['decoder'\], which match no saved module"):
        ait.load(TwoPart(), path, device_map={"encoder": "cpu", "decoder": "cpu"})
    with pytest.raises(InputError, match="'gpu0' is not a device"):
        ait.load(TwoPart(), path, device_map={"head": "gpu0"})
    built = ait.load(TwoPart(), path, device_map={"head": "cpu"})  # a part of the path names the modules under it
    assert built.head[1].state == "tuned"


def test_save_refuses_untuned_and_duplicate_names(toy_backends, tmp_path):
    with pytest.raises(ArtifactError, match="never tuned"):
        ait.save(ait.Module(SlowModule(), "m"), tmp_path / "x.ait")
    with pytest.raises(ArtifactError, match="share the names"):
        ait.save([tuned("same"), tuned("same")], tmp_path / "x.ait")


def test_a_killed_save_leaves_the_previous_artifact_intact(artifact, tmp_path):
    _, path = artifact
    before = path.read_bytes()
    ready = tmp_path / "ready"
    code = REGISTER_TOYS + textwrap.dedent(
        f"""
        import time, pathlib, torch, aitune.torch as ait
        from aitune import hookimpl
        from aitune.plugins import get_manager
        from aitune.testing.backends import ToyBackend
        from aitune_testkit.doubles import SlowModule

        class Stall:
            @hookimpl(wrapper=True)
            def aitune_serialize(self, backend, directory):
                meta = yield
                pathlib.Path({str(ready)!r}).touch()
                time.sleep(60)
                return meta

        m = ait.Module(SlowModule(delay_s=0), "m", strategy=ait.OneBackendStrategy(ToyBackend()).enable_performance_validation(False))
        ait.tune(m, [torch.randn(2, 8)])
        get_manager().register(Stall(), name="stall")
        ait.save(m, {str(path)!r})
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ})
    deadline = time.time() + 60
    while not ready.exists() and time.time() < deadline and child.poll() is None:
        time.sleep(0.05)
    assert ready.exists(), "the child never reached the middle of its save"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert path.read_bytes() == before
    ait.load(fresh(), path)


def test_cli_show_and_verify(artifact):
    _, path = artifact
    shown = CliRunner().invoke(app, ["show", str(path)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "toy" in shown.output and "x(batch, 8)" in shown.output
    # piped, each graph is one tab-separated line with the full module and backend names
    assert ["m", "0", "toy", "x(batch, 8)"] in [line.split("\t")[:4] for line in shown.output.splitlines()]
    manifest = json.loads(CliRunner().invoke(app, ["show", str(path), "--json"]).output)
    assert manifest["modules"][0]["graphs"][0]["backend"] == "toy"
    verified = CliRunner().invoke(app, ["verify", str(path), "--json"])
    assert verified.exit_code == 0 and json.loads(verified.output)["integrity"] == "ok"


def test_second_tune_reuses_cached_builds(toy_backends):
    first = tuned()
    report = ait.tune(first, [torch.randn(2, 8), torch.randn(4, 8)])
    candidate = report.modules[0].graphs[0].candidates[0]
    assert candidate.from_cache
    assert candidate.build_info["built_for"]
    result = CliRunner().invoke(app, ["cache", "info", "--json"])
    assert json.loads(result.output)["entries"] >= 1
    assert "removed" in CliRunner().invoke(app, ["cache", "clear"]).output
    assert json.loads(CliRunner().invoke(app, ["cache", "info", "--json"]).output)["entries"] == 0


def test_changed_weights_miss_the_cache(toy_backends):
    model = tuned()
    with torch.no_grad():
        model.fc.weight.add_(1.0)
    report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
    assert not report.modules[0].graphs[0].candidates[0].from_cache


def test_a_corrupt_cache_entry_is_rebuilt(toy_backends, _isolated_cache):
    tuned()
    for meta in (_isolated_cache / "builds").rglob("meta.json"):
        meta.write_text("{not json")
    torch.manual_seed(0)
    model = ait.Module(
        SlowModule(), "m", strategy=ait.OneBackendStrategy(ToyBackend(ToyConfig()), profiling_config=QUICK)
    )
    report = ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
    assert not report.modules[0].graphs[0].candidates[0].from_cache
    assert model.state == "tuned"
