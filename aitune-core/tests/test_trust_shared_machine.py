"""Trust on a machine shared with other accounts: modes whatever the umask, reads that cannot be
swapped, one file that stays vouched for, one switch parser, and a process with no home.

Each test is an attack another local account (or a container's arbitrary user id) could make; the
"another account" cases run as root, which can hand a file to another user id with ``os.chown``.
docs/security.md lists the promise each test holds.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from aitune_testkit import hostile
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune.artifact import ownkey, verify
from aitune.artifact.archive import file_sha256
from aitune.errors import ArtifactError, ConfigError
from aitune.testing.backends import ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=5, warmup=1, window=5), extend_s=0.0
)
DATA = [torch.randn(2, 8), torch.randn(4, 8)]
POSIX = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes only")
AS_ROOT = pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="hands files to another user id")
OTHER = 4242


def _tuned(speed: float = 0.0):
    torch.manual_seed(0)
    strategy = ait.OneBackendStrategy(hostile.NativeToyBackend(ToyConfig(speed=speed)), profiling_config=QUICK)
    model = ait.Module(SlowModule(delay_s=0.0), "m", strategy=strategy.enable_performance_validation(False))
    ait.tune(model, DATA)
    return model


def _fresh():
    return ait.Module(SlowModule(delay_s=0.0), "m")


def _speed(model) -> float:
    [(_, backend)] = model.tuned_graphs
    return backend.config.speed


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def native(toy_backends, register_plugin):
    register_plugin(hostile, name="aitune_testkit.hostile", distribution="aitune-testkit")


@pytest.fixture
def config(tmp_path, monkeypatch):
    path = tmp_path / "config"
    monkeypatch.setenv("AITUNE_CONFIG_DIR", str(path))
    return path


@pytest.fixture
def umask_000():
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


# -- modes whatever the umask ------------------------------------------------------------------------


@POSIX
def test_what_aitune_writes_is_private_whatever_the_umask(native, tmp_path, monkeypatch, config, umask_000):
    """Under umask 000: the artifact 0644, every folder aitune makes 0700 (the artifact's missing
    folders, the cache and config folders and their missing parents), the private key 0600."""
    config_dir = tmp_path / "home" / ".config" / "aitune"
    cache = tmp_path / "home" / ".cache" / "aitune"
    monkeypatch.setenv("AITUNE_CONFIG_DIR", str(config_dir))
    monkeypatch.setenv("AITUNE_CACHE_DIR", str(cache))
    (tmp_path / "home").mkdir(mode=0o755)
    model = _tuned()
    path = ait.save(model, tmp_path / "out" / "run-1" / "model.ait")
    assert _mode(path) == 0o644, "another account could rewrite the artifact in place"
    strategy = ait.OneBackendStrategy(hostile.NativeToyBackend(ToyConfig()), profiling_config=QUICK)
    again = ait.Module(SlowModule(delay_s=0.0), "m", strategy=strategy.enable_performance_validation(False))
    ait.tune(again, DATA, report_path=tmp_path / "reports" / "run.json")
    written = sorted((tmp_path / "reports").iterdir())
    assert written and all(_mode(f) == 0o644 for f in written), [(f.name, oct(_mode(f))) for f in written]
    assert _mode(tmp_path / "reports") == 0o700
    for folder in (tmp_path / "out", tmp_path / "out" / "run-1", config_dir.parent, config_dir, cache.parent, cache):
        assert _mode(folder) == 0o700, f"{folder} is {_mode(folder):o}"
    assert _mode(config_dir / "signing" / "key.pem") == 0o600
    assert ait.load(_fresh(), path).state == "tuned"


@AS_ROOT
def test_no_parent_is_made_inside_another_accounts_folder_and_a_foreign_parent_warns(tmp_path, monkeypatch):
    from aitune.cachedir import cache_dir

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER, -1)
    monkeypatch.setenv("AITUNE_CACHE_DIR", str(theirs / "sub" / "aitune"))
    with pytest.raises(ConfigError, match="belongs to another account"), pytest.warns(RuntimeWarning):
        cache_dir()
    assert not (theirs / "sub").exists(), "a folder was made inside another account's"
    monkeypatch.setenv("AITUNE_CACHE_DIR", str(theirs / "aitune"))
    with pytest.warns(RuntimeWarning, match=f"belongs to user id {OTHER}"):
        cache_dir()


# -- reads that cannot be swapped --------------------------------------------------------------------


@POSIX
def test_the_own_key_folder_swapped_after_it_was_opened_is_not_read(native, tmp_path, config, monkeypatch):
    """The key folder is read through one descriptor: exchanging it for another folder (renameat2,
    by an account that may write its parent) after the check changes nothing that is read."""
    ait.save(_tuned(), tmp_path / "mine.ait")
    mine = ownkey.existing()
    assert mine is not None
    planted = tmp_path / "planted"
    shutil.copytree(config / "signing", planted)
    (planted / "key.pub.pem").write_bytes(b"-----BEGIN PUBLIC KEY-----\nplanted\n-----END PUBLIC KEY-----\n")
    real_fstat, swapped = os.fstat, []

    def swapping_fstat(fd):
        info = real_fstat(fd)
        if not swapped and stat.S_ISDIR(info.st_mode):  # the key folder's descriptor was just checked
            swapped.append(True)
            os.rename(config / "signing", tmp_path / "aside")
            os.rename(planted, config / "signing")
        return info

    monkeypatch.setattr(os, "fstat", swapping_fstat)
    again = ownkey.existing()
    monkeypatch.undo()
    assert swapped, "the swap never ran: the test no longer races the reader"
    assert again is not None and again.public_pem == mine.public_pem, "the key was read from the swapped-in folder"


@POSIX
@pytest.mark.parametrize("attack", ["folder-link", "key-link", "another-account"])
def test_a_key_folder_or_key_that_is_a_link_or_not_yours_is_not_used(native, tmp_path, config, attack):
    if attack == "another-account" and os.getuid() != 0:
        pytest.skip("hands a folder to another user id")
    path = ait.save(_tuned(), tmp_path / "mine.ait")
    theirs = tmp_path / "theirs"
    shutil.copytree(config / "signing", theirs)
    if attack == "folder-link":
        shutil.rmtree(config / "signing")
        (config / "signing").symlink_to(theirs)
    elif attack == "key-link":
        (config / "signing" / "key.pub.pem").unlink()
        (config / "signing" / "key.pub.pem").symlink_to(theirs / "key.pub.pem")
    else:
        os.chown(config / "signing", OTHER, -1)
    with pytest.warns(RuntimeWarning, match="does not use your signing key"):
        assert ownkey.existing() is None
    with pytest.warns(RuntimeWarning, match="does not use your signing key"), pytest.raises(ArtifactError):
        ait.load(_fresh(), path)


@pytest.fixture
def good_and_planted(native, tmp_path):
    good = ait.save(_tuned(0.0), tmp_path / "model.ait", sign=False)
    planted = ait.save(_tuned(0.25), tmp_path / "planted.ait", sign=False)
    return good, planted


def _rewrite_through(descriptor, planted: Path, monkeypatch) -> list[str]:
    """Rewrite the file through ``descriptor`` the moment the reader parses the zip: after the pin was
    checked (a descriptor another account opened while the file was 0666 survives chmod)."""
    done: list[str] = []

    class Rewriting(zipfile.ZipFile):
        def __init__(self, file, *args, **kwargs):
            if not done:
                done.append("rewritten")
                descriptor.seek(0)
                descriptor.write(planted.read_bytes())
                descriptor.truncate()
                descriptor.flush()
            super().__init__(file, *args, **kwargs)

    monkeypatch.setattr(zipfile, "ZipFile", Rewriting)
    return done


@POSIX
def test_a_pinned_file_rewritten_through_an_old_descriptor_is_not_read(good_and_planted, monkeypatch):
    good, planted = good_and_planted
    pin = file_sha256(good)
    with open(good, "r+b") as old_descriptor:  # opened while others could; the file is 0644 now
        good.chmod(0o644)
        rewritten = _rewrite_through(old_descriptor, planted, monkeypatch)
        model = ait.load(_fresh(), good, expected_sha256=pin)
    assert rewritten and file_sha256(good) != pin, "the file was not rewritten: the test no longer races the reader"
    assert model.state == "tuned" and _speed(model) == 0.0, "the planted payload was parsed under the pin"


@AS_ROOT
def test_another_accounts_sparse_file_is_refused_before_any_copy(tmp_path):
    big = tmp_path / "big.ait"
    with open(big, "wb") as f:
        f.truncate(4 << 30)  # 4 GiB claimed, nothing on disk
    os.chown(big, OTHER, -1)
    with pytest.raises(ArtifactError, match="sparse file"):
        ait.load(_fresh(), big, expected_sha256="0" * 64)


# -- one file ----------------------------------------------------------------------------------------


def test_a_copied_artifact_stays_vouched_for_by_its_owners_key(native, tmp_path, config):
    """The own-key signature is inside the file: the .ait copied alone still loads with no flag, a
    colleague holding the public key trusts it, and a member changed and summed again breaks it."""
    saved = ait.save(_tuned(), tmp_path / "here" / "model.ait")
    assert not saved.with_name("model.ait.sig").exists(), "ait.save wrote a second file"
    copied = Path(shutil.copy(saved, tmp_path / "model-copy.ait"))
    model = ait.load(_fresh(), copied)
    assert model.state == "tuned", "the copied artifact lost its owner's vouching"
    assert "signed by your own key" in verify(copied)["trust"]
    public = config / "signing" / "key.pub.pem"
    result = verify(copied, trusted_keys=[public])
    assert result["runnable_here"] and "signed inside the file by the key key.pub.pem" in result["trust"]

    import hashlib

    with zipfile.ZipFile(copied) as z:
        members = {n: z.read(n) for n in z.namelist() if n != "SHA256SUMS"}
    members["manifest.json"] = members["manifest.json"].replace(b'"created_at"', b'"created_at" ', 1)
    sums = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in sorted(members.items()) if n != "SIGNATURE")
    edited = tmp_path / "edited.ait"
    with zipfile.ZipFile(edited, "w") as z:
        for name, data in members.items():
            if name != "SIGNATURE":
                z.writestr(name, data)
        z.writestr("SHA256SUMS", sums)
        z.writestr("SIGNATURE", members["SIGNATURE"])  # the owner's signature, over the old list
    with pytest.raises(ArtifactError, match="native code"):
        ait.load(_fresh(), edited)
    with pytest.raises(ArtifactError, match="not signed by a key you trust"):
        ait.load(_fresh(), edited, trusted_keys=[public])


def test_the_own_key_needs_nothing_beyond_the_quick_start_install(tmp_path):
    """No model-signing (the README's install has no [signing] extra): the user's own artifact with a
    native payload still loads back for them with no flag."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["model_signing"] = None  # not installed
        import warnings
        warnings.simplefilter("error")
        import torch
        import aitune.torch as ait
        from aitune.plugins import get_manager
        from aitune_testkit import hostile
        from aitune_testkit.doubles import SlowModule
        from aitune.testing.backends import ToyConfig
        from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

        get_manager().register(hostile, name="aitune_testkit.hostile")
        quick = ProfilingConfig(measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=5, warmup=1, window=5), extend_s=0.0)
        strategy = ait.OneBackendStrategy(hostile.NativeToyBackend(ToyConfig()), profiling_config=quick)
        model = ait.Module(SlowModule(delay_s=0.0), "m", strategy=strategy.enable_performance_validation(False))
        ait.tune(model, [torch.randn(2, 8), torch.randn(4, 8)])
        path = ait.save(model, {str(tmp_path / "model.ait")!r})
        assert ait.load(ait.Module(SlowModule(delay_s=0.0), "m"), path).state == "tuned"
        print("own key ok")
        """
    )
    env = {**os.environ, "AITUNE_CONFIG_DIR": str(tmp_path / "config"), "AITUNE_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "own key ok" in out.stdout, out.stderr[-3000:]


# -- one switch parser; a process with no home -------------------------------------------------------


@pytest.mark.parametrize("spelling", ["disabled", "none", "never", "n", "nope"])
def test_a_switch_spelt_otherwise_than_aitune_reads_it_is_refused(native, tmp_path, config, monkeypatch, spelling):
    monkeypatch.setenv("AITUNE_OWN_KEY", spelling)
    with pytest.raises(ConfigError, match=r"AITUNE_OWN_KEY=.* is not a switch aitune understands.*1, true, yes, on"):
        ait.save(_tuned(), tmp_path / "model.ait")
    monkeypatch.setenv("AITUNE_OWN_KEY", "0")
    monkeypatch.setenv("AITUNE_BUILD_CACHE", spelling)
    with pytest.raises(ConfigError, match="AITUNE_BUILD_CACHE"):
        ait.tune(ait.Module(SlowModule(delay_s=0.0), "m"), DATA, fail_fast=True)


@pytest.mark.parametrize("spelling", ["0", "false", "OFF", " no "])
def test_every_off_spelling_turns_the_own_key_off(native, tmp_path, config, monkeypatch, spelling):
    monkeypatch.setenv("AITUNE_OWN_KEY", spelling)
    with pytest.warns(RuntimeWarning, match="AITUNE_OWN_KEY is off"):
        path = ait.save(_tuned(), tmp_path / "model.ait")
    with pytest.raises(ArtifactError, match="native code"):
        ait.load(_fresh(), path)


@pytest.mark.parametrize("home", ["unset", "empty"])
def test_a_process_with_no_home_tunes_saves_and_loads_with_one_warning(toy_backends, tmp_path, monkeypatch, home):
    """A container's arbitrary user id: no HOME and no passwd entry (or ``HOME=""``). There is no own
    key, the cache is a private folder under the temporary folder, and one warning says so."""
    import tempfile
    from pathlib import Path as PathType

    from aitune import envvars

    for variable in ("AITUNE_CACHE_DIR", "AITUNE_CONFIG_DIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(variable, raising=False)
    if home == "unset":
        monkeypatch.delenv("HOME", raising=False)

        def no_home():
            raise RuntimeError("Could not determine home directory")

        monkeypatch.setattr(PathType, "home", staticmethod(no_home))
    else:
        monkeypatch.setenv("HOME", "")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    envvars._warn_homeless.cache_clear()
    from aitune.testing.backends import ToyBackend

    strategy = ait.OneBackendStrategy(ToyBackend(ToyConfig()), profiling_config=QUICK)
    model = ait.Module(SlowModule(delay_s=0.0), "m", strategy=strategy.enable_performance_validation(False))
    with pytest.warns(RuntimeWarning, match="no home folder") as warned:
        ait.tune(model, DATA)
        path = ait.save(model, tmp_path / "model.ait")
        assert ait.load(_fresh(), path).state == "tuned"
    assert len([w for w in warned if "no home folder" in str(w.message)]) == 1
    cache = tmp_path / f"aitune-{os.getuid()}"
    assert cache.is_dir() and _mode(cache) == 0o700
    assert not PathType("/.config/aitune").exists() and not PathType("/.cache/aitune").exists()
    with zipfile.ZipFile(path) as z:
        assert "SIGNATURE" not in z.namelist(), "a key was made with no home to keep it in"
