"""What aitune trusts: a file it reads never imports, calls or runs what it names unless told to.

Each test is one attack on an artifact, a cache entry or the JIT store (docs/security.md lists
them with the promise each one checks). An attacked file ends in an ArtifactError, or a refusal
that names the fix, and runs nothing.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from aitune_testkit import hostile
from aitune_testkit.doubles import SlowModule

import aitune.torch as ait
from aitune import tree
from aitune.artifact import verify
from aitune.cachedir import cache_dir
from aitune.errors import ArtifactError, ConfigError, InputError, ValidationError
from aitune.testing.backends import ToyBackend, ToyConfig
from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

QUICK = ProfilingConfig(
    measurement_stop_strategy=NumStepsMeasuringStopStrategy(num_steps=5, warmup=1, window=5), extend_s=0.0
)
DATA = [torch.randn(2, 8), torch.randn(4, 8)]


def _tuned(backend=None, name="m"):
    torch.manual_seed(0)
    strategy = ait.OneBackendStrategy(backend or ToyBackend(ToyConfig()), profiling_config=QUICK)
    model = ait.Module(SlowModule(delay_s=0.0), name, strategy=strategy.enable_performance_validation(False))
    ait.tune(model, DATA)
    return model


def _fresh(name="m"):
    return ait.Module(SlowModule(delay_s=0.0), name)


def _rewrite(src: Path, dst: Path, manifest_change=None, members_change=None) -> Path:
    """Copy an artifact with an edited manifest or members, its digest list summed again (as an attacker would)."""
    import hashlib

    with zipfile.ZipFile(src) as z:
        members = {n: z.read(n) for n in z.namelist() if n != "SHA256SUMS"}
    if manifest_change is not None:
        manifest = json.loads(members["manifest.json"])
        manifest_change(manifest)
        members["manifest.json"] = json.dumps(manifest).encode()
    if members_change is not None:
        members_change(members)
    sums = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in sorted(members.items()))
    with zipfile.ZipFile(dst, "w") as z:
        for n, d in members.items():
            z.writestr(n, d)
        z.writestr("SHA256SUMS", sums)
    return dst


def _graph(manifest):
    return manifest["modules"][0]["graphs"][0]


@pytest.fixture
def saved(toy_backends, tmp_path):
    return ait.save(_tuned(), tmp_path / "model.ait")


# -- imports and constructors a file names ----------------------------------------------------------


def test_a_type_from_a_module_not_imported_is_refused_and_never_imported(saved, tmp_path):
    def name_a_module(manifest):
        _graph(manifest)["graph"]["output_structure"] = {
            "kind": "namedtuple",
            "type": "aitune_testkit.imported_by_name:Anything",
            "keys": [],
            "items": [],
        }

    bad = _rewrite(saved, tmp_path / "bad.ait", name_a_module)
    code = textwrap.dedent(
        f"""
        import os, sys
        import aitune.torch as ait
        from aitune.artifact import verify
        from aitune.errors import ArtifactError
        from aitune.plugins import get_manager
        import aitune.testing.backends as tb
        from aitune_testkit.doubles import SlowModule
        get_manager().register(tb, name="aitune.testing.backends", distribution="aitune-core")
        for attempt in (
            lambda: ait.load(ait.Module(SlowModule(), "m"), {str(bad)!r}),
            lambda: ait.load(ait.Module(SlowModule(), "m"), {str(bad)!r}, fallback="eager"),
        ):
            try:
                attempt()
            except ArtifactError as exc:
                print("refused:", exc)
        result = verify({str(bad)!r})
        print("runnable:", result["runnable_here"])
        print("imported:", "aitune_testkit.imported_by_name" in sys.modules, os.environ.get("AITUNE_TESTKIT_IMPORTED_BY_NAME"))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused:" in out.stdout and "import aitune_testkit" in out.stdout, out.stdout
    assert "runnable: False" in out.stdout
    assert "imported: False None" in out.stdout, "a module was imported because the file named it"


def test_type_paths_resolve_only_among_loaded_modules():
    assert tree.resolve("collections:OrderedDict") is __import__("collections").OrderedDict
    for name in ("this:Anything", "antigravity:X", "unittest.__main__:main", "os:system", "os.path:join"):
        with pytest.raises(InputError):
            tree.resolve(name)
    assert "this" not in sys.modules and "antigravity" not in sys.modules
    with pytest.raises(InputError, match="not a type path"):
        tree.resolve("os; import this:X")


def test_a_dataclass_is_rebuilt_without_running_its_constructor(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not leak")
    structure = {
        "kind": "dataclass",
        "type": "aitune_testkit.hostile:ReadsFile",
        "keys": ["path", "out"],
        "items": [{"kind": "const", "value": str(secret)}, {"kind": "tensor"}],
    }
    tree.check_types(structure)
    rebuilt = tree.unflatten(structure, [torch.ones(2)])
    assert isinstance(rebuilt, hostile.ReadsFile) and rebuilt.path == str(secret)
    assert rebuilt.contents is None, "the constructor ran on values a file gave"
    # and what aitune recorded itself round-trips exactly, after the constructor ran once in eager
    leaves, recorded = tree.flatten(hostile.ReadsFile(str(secret), torch.zeros(1)))
    again = tree.unflatten(recorded, leaves)
    assert again.contents == "do not leak" and again.path == str(secret)


def test_named_tuples_and_model_outputs_are_rebuilt_as_data():
    leaves, structure = tree.flatten(hostile.Pair(torch.ones(1), 3))
    back = tree.unflatten(structure, leaves)
    assert type(back) is hostile.Pair and back.b == 3 and torch.equal(back.a, torch.ones(1))
    transformers = pytest.importorskip("transformers")
    out = transformers.modeling_outputs.BaseModelOutput(last_hidden_state=torch.ones(2), hidden_states=None)
    leaves, structure = tree.flatten(out)
    back = tree.unflatten(structure, leaves)
    assert type(back) is type(out) and list(back.keys()) == ["last_hidden_state"]
    assert (
        back.hidden_states is None
        and torch.equal(back[0], torch.ones(2))
        and torch.equal(back.last_hidden_state, back[0])
    )


def test_a_pytree_node_that_names_a_callable_is_refused(saved, tmp_path):
    structure = {
        "kind": "pytree",
        "type": "collections:defaultdict",
        "context": ["os.abort", ["a"]],
        "items": [{"kind": "tensor"}],
    }
    with pytest.raises(InputError, match="not one"):
        tree.check_types(structure)

    def plant(manifest):
        _graph(manifest)["graph"]["output_structure"] = structure

    bad = _rewrite(saved, tmp_path / "bad.ait", plant)
    with pytest.raises(ArtifactError):
        ait.load(_fresh(), bad)
    from collections import defaultdict

    with pytest.raises(Exception, match="context"):
        tree.flatten(defaultdict(list, a=torch.ones(1)))


# -- settings, paths and devices a file gives ---------------------------------------------------------


def test_inductor_options_from_a_file_are_allow_listed(saved, tmp_path, aitune_manager):
    pytest.importorskip("aitune_backend_inductor")
    registry = aitune_manager.registry
    for options, named in (
        ({"cpp.cxx": "/bin/false"}, "cpp.cxx"),
        ({"cpp.inject_relu_bug_TESTING_ONLY": "compile_error"}, "inject_relu_bug_TESTING_ONLY"),
        ({"max_autotune": "/tmp/x"}, "max_autotune"),
    ):
        data = {"backend": "torch_inductor_jit", "options": options}
        assert registry.config_from_json(data).options == options, "the user's own code may set anything"
        with pytest.raises(ConfigError, match=named):
            registry.config_from_json(data, from_file=True)
    safe = {"backend": "torch_inductor_jit", "options": {"epilogue_fusion": True, "max_autotune": False}}
    assert registry.config_from_json(safe, from_file=True).options == safe["options"]

    def compiler(manifest):
        graph = _graph(manifest)
        graph["backend"], graph["config"] = (
            "torch_inductor_jit",
            {"backend": "torch_inductor_jit", "options": {"cpp.cxx": "/bin/false"}},
        )

    bad = _rewrite(saved, tmp_path / "bad.ait", compiler)
    with pytest.raises(ArtifactError, match="cpp.cxx"):
        ait.load(_fresh(), bad)
    result = verify(bad)
    assert not result["runnable_here"] and any("cpp.cxx" in p for p in result["problems"])


def test_a_manifest_naming_the_meta_device_is_refused(saved, tmp_path):
    def meta(manifest):
        for spec in _graph(manifest)["graph"]["inputs"]:
            spec["device"] = "meta"

    bad = _rewrite(saved, tmp_path / "bad.ait", meta)
    model = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ArtifactError, match="meta"):
        ait.load(model, bad)
    assert all(v.device.type == "cpu" for v in model.state_dict().values()), "the weights left the CPU"
    assert before.keys() == model.state_dict().keys()


def test_overlapping_zip_entries_are_refused_before_anything_is_read(saved, tmp_path):
    """Many directory entries sharing one member's bytes: a small file that reads as gigabytes."""
    data = bytearray(saved.read_bytes())
    with zipfile.ZipFile(saved) as z:
        infos = z.infolist()
    big = max(infos, key=lambda i: i.file_size)
    starts = [i for i in range(len(data) - 4) if data[i : i + 4] == b"PK\x01\x02"]
    victim = next(s for s, info in zip(starts, infos) if info.filename != big.filename)
    data[victim + 42 : victim + 46] = struct.pack("<I", big.header_offset)  # point it at the big member
    bad = tmp_path / "overlap.ait"
    bad.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="overlaps|more than the file|order"):
        ait.load(_fresh(), bad)
    with pytest.raises(ArtifactError):
        verify(bad)


# -- SystemExit and friends never escape ---------------------------------------------------------------


def test_a_systemexit_while_loading_ends_in_an_artifact_error(saved, monkeypatch):
    def exits(self, module, directory, context):
        raise SystemExit(3)

    monkeypatch.setattr(ToyBackend, "load", exits)
    with pytest.raises(ArtifactError, match="SystemExit"):
        ait.load(_fresh(), saved)
    with pytest.warns(RuntimeWarning, match="SystemExit"):
        model = ait.load(_fresh(), saved, fallback="eager")
    assert model.state == "passthrough", "with fallback='eager' the module keeps serving, eager"


# -- native payloads run only when trusted --------------------------------------------------------------


@pytest.fixture
def native(toy_backends, register_plugin, tmp_path, monkeypatch):
    """An artifact with a native payload that another user saved (signed with their own key)."""
    register_plugin(hostile, name="aitune_testkit.hostile", distribution="aitune-testkit")
    with monkeypatch.context() as other_user:
        other_user.setenv("AITUNE_CONFIG_DIR", str(tmp_path / "their-config"))
        path = ait.save(_tuned(hostile.NativeToyBackend(ToyConfig())), tmp_path / "native.ait")
    assert _sealed(path) and not path.with_name("native.ait.sig").exists(), "one file: the signature is inside"
    return path


def _sealed(path: Path) -> bool:
    """The artifact carries a signature inside it (aitune.artifact.seal)."""
    with zipfile.ZipFile(path) as z:
        return "SIGNATURE" in z.namelist()


def test_a_native_payload_needs_trust(native):
    with pytest.raises(ArtifactError, match="native code") as refused:
        ait.load(_fresh(), native)
    assert "expected_sha256" in str(refused.value) and "trust_native_code" in str(refused.value)
    with pytest.warns(RuntimeWarning, match="native code"):
        assert ait.load(_fresh(), native, fallback="eager").state == "passthrough"
    from aitune.artifact.archive import file_sha256

    assert ait.load(_fresh(), native, expected_sha256=file_sha256(native)).state == "tuned"
    assert ait.load(_fresh(), native, trust_native_code=True).state == "tuned"
    result = verify(native)
    assert result["native_payloads"] and not result["runnable_here"]
    assert "not established" in result["trust"]
    assert verify(native, file_sha256(native))["runnable_here"]


def test_digests_catch_corruption_not_tampering(native, tmp_path):
    """An edited, re-summed artifact is whole (integrity ok) but not trusted: native code stays refused."""
    edited = _rewrite(native, tmp_path / "edited.ait", lambda m: m.update(created_at="then"))
    result = verify(edited)
    assert result["integrity"] == "ok" and not result["runnable_here"]
    with pytest.raises(ArtifactError, match="native code"):
        ait.load(_fresh(), edited)


@pytest.fixture
def keys(tmp_path):
    pytest.importorskip("model_signing", reason="pip install 'aitune-core[signing]'")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    def pair(name):
        key = ec.generate_private_key(ec.SECP256R1())
        private, public = tmp_path / f"{name}.pem", tmp_path / f"{name}.pub.pem"
        private.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        public.write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        return private, public

    return pair("mine"), pair("theirs")


def test_a_signed_artifact_loads_with_the_trusted_key_only(toy_backends, register_plugin, tmp_path, keys):
    from typer.testing import CliRunner

    from aitune.cli import app

    (mine, mine_public), (theirs, theirs_public) = keys
    register_plugin(hostile, name="aitune_testkit.hostile", distribution="aitune-testkit")
    path = ait.save(_tuned(hostile.NativeToyBackend(ToyConfig())), tmp_path / "signed.ait", signing_key=mine)
    assert (tmp_path / "signed.ait.sig").is_file()
    assert ait.load(_fresh(), path, trusted_keys=[mine_public]).state == "tuned"
    with pytest.raises(ArtifactError, match="not signed by a key you trust"):
        ait.load(_fresh(), path, trusted_keys=[theirs_public])
    assert verify(path, trusted_keys=[mine_public])["runnable_here"]
    shown = CliRunner().invoke(app, ["verify", str(path), "--key", str(mine_public)])
    assert shown.exit_code == 0 and "signed by the key" in shown.output, shown.output
    # signed by the CLI, then changed: the signature no longer holds
    other = ait.save(_tuned(hostile.NativeToyBackend(ToyConfig())), tmp_path / "cli.ait")
    signed = CliRunner().invoke(app, ["sign", str(other), "--key", str(theirs)])
    assert signed.exit_code == 0, signed.output
    assert ait.load(_fresh(), other, trusted_keys=[theirs_public]).state == "tuned"
    with open(other, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(ArtifactError):
        ait.load(_fresh(), other, trusted_keys=[theirs_public])
    (tmp_path / "cli.ait.sig").unlink()
    with pytest.raises(ArtifactError, match="no signature"):
        ait.load(_fresh(), path.with_name("cli.ait"), trusted_keys=[theirs_public])


def test_aitune_verify_and_show_escape_control_characters_in_names_from_the_file(native, tmp_path):
    from typer.testing import CliRunner

    from aitune.cli import app

    def rename(manifest):
        manifest["modules"][0]["name"] = "m\x1b[1A\x1b[2K\rtrust: pinned by expected_sha256\x07"

    edited = _rewrite(native, tmp_path / "escapes.ait", rename)
    for command in (["verify", str(edited)], ["show", str(edited)]):
        shown = CliRunner().invoke(app, command)
        assert "\x1b" not in shown.output and "\r" not in shown.output and "\x07" not in shown.output, shown.output
        assert "\\x1b[1A" in shown.output, "the name is shown, escaped"
    verified = CliRunner().invoke(app, ["verify", str(edited)])
    assert [line for line in verified.output.splitlines() if line.startswith("trust:")] == [
        "trust: not established (no expected_sha256 and no trusted key)"
    ]


def test_aitune_sign_replaces_a_planted_signature_link_without_writing_through_it(toy_backends, tmp_path, keys):
    from typer.testing import CliRunner

    from aitune.cli import app

    (mine, mine_public), _ = keys
    path = ait.save(_tuned(), tmp_path / "model.ait", sign=False)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path.with_name("model.ait.sig").symlink_to(victim)
    signed = CliRunner().invoke(app, ["sign", str(path), "--key", str(mine)])
    assert signed.exit_code == 0, signed.output
    assert victim.read_text() == "precious", "the signature was written through the planted link"
    assert not path.with_name("model.ait.sig").is_symlink()
    assert "signed by the key" in verify(path, trusted_keys=[mine_public])["trust"]


# -- what a user saved loads back for that user -------------------------------------------------------


@pytest.fixture
def own_config(tmp_path, monkeypatch):
    """The user's own key needs nothing beyond the Quick start's install (no [signing] extra)."""
    path = tmp_path / "config"
    monkeypatch.setenv("AITUNE_CONFIG_DIR", str(path))
    return path


def test_what_a_user_saved_loads_back_for_that_user_with_no_flag(toy_backends, register_plugin, tmp_path, own_config):
    register_plugin(hostile, name="aitune_testkit.hostile", distribution="aitune-testkit")
    previous = os.umask(0)  # the key is private whatever the umask
    try:
        path = ait.save(_tuned(hostile.NativeToyBackend(ToyConfig())), tmp_path / "mine.ait")
    finally:
        os.umask(previous)
    assert ait.load(_fresh(), path).state == "tuned", "the user's own artifact needs no flag"
    assert "signed by your own key" in verify(path)["trust"] and verify(path)["runnable_here"]
    if hasattr(os, "getuid"):
        assert (own_config / "signing" / "key.pem").stat().st_mode & 0o777 == 0o600
        assert (own_config / "signing").stat().st_mode & 0o777 == 0o700
        assert own_config.stat().st_mode & 0o777 == 0o700


def test_an_artifact_signed_by_another_users_key_is_refused(native, own_config):
    ait.save(_tuned(), own_config.parent / "makes-my-key.ait")  # the user has a key of their own
    assert (own_config / "signing" / "key.pub.pem").is_file()
    with pytest.raises(ArtifactError, match="native code"):
        ait.load(_fresh(), native)
    assert "not established" in verify(native)["trust"]


def test_your_own_artifact_changed_since_you_saved_it_warns_and_is_checked(toy_backends, tmp_path, own_config):
    """Edited and summed again, the file still carries your signature, which no longer checks: you are
    told (not only the trust quietly dropped), and the load falls back to the check against eager."""
    path = ait.save(_tuned(), tmp_path / "mine.ait")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # untouched, it loads with no word
        assert ait.load(_fresh(), path).state == "tuned"
    edited = _rewrite(path, tmp_path / "edited.ait", lambda m: m.update(created_at="then"))
    assert _sealed(edited)
    with pytest.warns(RuntimeWarning, match="signed by your own key .* and was changed since it was signed"):
        assert ait.load(_fresh(), edited).state == "tuned", "a toy payload that matches eager passes the check"


def test_another_users_signature_is_not_taken_for_a_change_to_yours(native, own_config):
    ait.save(_tuned(), own_config.parent / "makes-my-key.ait")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ArtifactError, match="native code"):
            ait.load(_fresh(), native)
    assert not [w for w in seen if "changed since it was signed" in str(w.message)]


@pytest.mark.parametrize("opt_out", ["sign=False", "AITUNE_OWN_KEY=0"])
def test_saving_unsigned_is_an_opt_out(toy_backends, register_plugin, tmp_path, own_config, monkeypatch, opt_out):
    register_plugin(hostile, name="aitune_testkit.hostile", distribution="aitune-testkit")
    model = _tuned(hostile.NativeToyBackend(ToyConfig()))
    path = ait.save(model, tmp_path / "model.ait")  # signed: a later unsigned save must not leave it beside
    if opt_out == "sign=False":
        ait.save(model, path, sign=False)
    else:
        monkeypatch.setenv("AITUNE_OWN_KEY", "0")
        with pytest.warns(RuntimeWarning, match=r"saved unsigned \(AITUNE_OWN_KEY is off\)"):
            ait.save(model, path)
    assert not path.with_name("model.ait.sig").exists() and not _sealed(path)
    with pytest.raises(ArtifactError, match="native code"):
        ait.load(_fresh(), path)


def test_a_key_folder_others_may_write_is_not_trusted(toy_backends, register_plugin, tmp_path, own_config):
    if not hasattr(os, "getuid"):
        pytest.skip("POSIX owners and modes only")
    register_plugin(hostile, name="aitune_testkit.hostile", distribution="aitune-testkit")
    path = ait.save(_tuned(hostile.NativeToyBackend(ToyConfig())), tmp_path / "mine.ait")
    (own_config / "signing").chmod(0o777)  # anyone could have put their public key there
    with pytest.warns(RuntimeWarning, match="does not use your signing key"), pytest.raises(ArtifactError):
        ait.load(_fresh(), path)
    (own_config / "signing").chmod(0o700)
    (own_config / "signing" / "key.pub.pem").unlink()
    with pytest.warns(RuntimeWarning, match="key pair in it is incomplete"):
        ait.save(_tuned(), tmp_path / "unsigned.ait")
    assert not _sealed(tmp_path / "unsigned.ait")


# -- what was checked is what is read ----------------------------------------------------------------


def _swap_when_the_archive_opens(monkeypatch, target: Path, planted: Path, in_place: bool = False) -> list[str]:
    """Replace the file at ``target`` with ``planted`` the moment the reader opens the zip: after the pin
    or the signature was checked, before a member is read (the race a shared model folder allows)."""
    done: list[str] = []

    class Swapping(zipfile.ZipFile):
        def __init__(self, file, *args, **kwargs):
            if not done:
                done.append("swapped")
                if in_place:  # same inode, new bytes: what a user who may write the file can do
                    with open(target, "r+b") as f:
                        f.write(planted.read_bytes())
                        f.truncate()
                else:
                    os.replace(planted, target)
            super().__init__(file, *args, **kwargs)

    monkeypatch.setattr(zipfile, "ZipFile", Swapping)
    return done


def _speed(model) -> float:
    [(_, backend)] = model.tuned_graphs
    return backend.config.speed


@pytest.fixture
def good_and_planted(toy_backends, register_plugin, tmp_path):
    register_plugin(hostile, name="aitune_testkit.hostile", distribution="aitune-testkit")
    good = ait.save(
        _tuned(hostile.NativeToyBackend(ToyConfig(speed=0.0))), tmp_path / "shared" / "model.ait", sign=False
    )
    planted = ait.save(_tuned(hostile.NativeToyBackend(ToyConfig(speed=0.25))), tmp_path / "planted.ait", sign=False)
    return good, planted


@pytest.mark.parametrize("in_place", [False, True], ids=["replaced", "rewritten-in-place"])
def test_a_file_swapped_after_the_pin_is_checked_is_not_read(good_and_planted, monkeypatch, in_place):
    from aitune.artifact.archive import file_sha256

    good, planted = good_and_planted
    pin = file_sha256(good)
    if in_place:
        good.chmod(0o666)  # others may write it: aitune reads a private copy
    swapped = _swap_when_the_archive_opens(monkeypatch, good, planted, in_place)
    model = ait.load(_fresh(), good, expected_sha256=pin)
    assert swapped, "the hook never ran: the test no longer races the reader"
    assert file_sha256(good) != pin, "the file at the path is the planted one now"
    assert model.state == "tuned" and _speed(model) == 0.0, "the planted payload was loaded under the pin"


@pytest.mark.parametrize("in_place", [False, True], ids=["replaced", "rewritten-in-place"])
def test_a_file_swapped_after_the_signature_is_checked_is_not_read(good_and_planted, monkeypatch, keys, in_place):
    (mine, mine_public), _ = keys
    good, planted = good_and_planted
    from aitune.artifact.signing import sign

    sign(good, mine)
    if in_place:
        good.chmod(0o666)  # others may write it: the signature is checked on aitune's private copy
    swapped = _swap_when_the_archive_opens(monkeypatch, good, planted, in_place)
    model = ait.load(_fresh(), good, trusted_keys=[mine_public])
    assert swapped
    assert model.state == "tuned" and _speed(model) == 0.0, "the planted payload was loaded under the signature"


# -- the cache is the user's own ---------------------------------------------------------------------


def test_the_cache_folder_is_created_private_and_a_shared_one_refused(tmp_path, monkeypatch):
    if not hasattr(os, "getuid"):
        pytest.skip("POSIX owners and modes only")
    monkeypatch.setenv("AITUNE_CACHE_DIR", str(tmp_path / "new" / "cache"))
    folder = cache_dir()
    assert folder.stat().st_mode & 0o777 == 0o700
    folder.chmod(0o777)
    with pytest.raises(ConfigError, match="move it away or empty it") as refused:
        cache_dir()
    assert "AITUNE_CACHE_DIR" in str(refused.value) and "chmod alone keeps them" in str(refused.value)
    folder.chmod(0o755)  # readable by others, writable by you alone: accepted
    assert cache_dir() == folder
    if os.getuid() == 0:
        os.chown(folder, 4242, -1)
        with pytest.raises(ConfigError, match="belongs to user id 4242"):
            cache_dir()


def test_a_planted_cache_payload_is_refused_and_rebuilt(toy_backends, _isolated_cache):
    _tuned()
    [payload] = (_isolated_cache / "builds").rglob("toy.txt")
    payload.write_text("0.0\n# planted")  # another user's library, in the real attack
    model = _tuned()
    candidate = model.report.graphs[0].candidates[0]
    assert not candidate.from_cache, "a changed cache entry was used"
    assert model.state == "tuned"
    assert payload.read_text() == "0.0", "the entry was rebuilt from a fresh build"


def _plant(entry: Path, speed: str) -> None:
    """Another user's payload in a build cache entry, with its digests recomputed as they would."""
    from aitune.cachedir import digests

    [payload] = entry.rglob("toy.txt")
    payload.write_text(speed)
    meta = json.loads((entry / "meta.json").read_text())
    meta["metadata"]["speed"] = float(speed)
    meta["files"] = digests(entry / "payload")
    (entry / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("planted_as", ["another user", "writable by others"])
def test_entries_planted_while_the_cache_was_shared_are_evicted_after_chmod_700(
    toy_backends, _isolated_cache, planted_as
):
    """The refusal's old advice, chmod 700, leaves what another user put in the folder: each entry is
    checked for its owner and mode before use, so theirs are removed (with a warning) and built again."""
    if not hasattr(os, "getuid"):
        pytest.skip("POSIX owners and modes only")
    if planted_as == "another user" and os.getuid() != 0:
        pytest.skip("giving files to another user needs root (os.chown)")
    _tuned()
    [meta] = (_isolated_cache / "builds").rglob("meta.json")
    entry = meta.parent
    _isolated_cache.chmod(0o777)  # shared for a while: someone plants an entry with its digests recomputed
    _plant(entry, "0.5")
    for path in (entry, *entry.rglob("*")):
        if planted_as == "another user":
            os.chown(path, 4242, 4242)
        else:
            path.chmod(0o777 if path.is_dir() else 0o666)
    _isolated_cache.chmod(0o700)  # what the refusal used to recommend
    with pytest.warns(RuntimeWarning, match="not yours alone"):
        model = _tuned()
    assert not model.report.graphs[0].candidates[0].from_cache, "the planted entry was used"
    [payload] = (_isolated_cache / "builds").rglob("toy.txt")
    assert payload.read_text() == "0.0", "the entry was rebuilt from a fresh build"
    assert not list((_isolated_cache / "builds").rglob(".evicted-*")), "the planted entry is still on disk"


def test_cache_folders_are_created_private_under_umask_000(toy_backends, tmp_path, monkeypatch):
    """An existing 0755 cache and umask 000: builds/ and jit/ (and each entry) are still 0700."""
    if not hasattr(os, "getuid"):
        pytest.skip("POSIX modes only")
    from aitune.builtin.buildcache import builds_dir
    from aitune.engine.jit.decision_store import jit_dir

    root = tmp_path / "cache"
    root.mkdir(mode=0o755)
    monkeypatch.setenv("AITUNE_CACHE_DIR", str(root))
    previous = os.umask(0)
    try:
        _tuned()
        jit_dir()
    finally:
        os.umask(previous)
    assert builds_dir() == root / "builds" and jit_dir() == root / "jit"
    folders = [p for p in root.rglob("*") if p.is_dir()]
    assert root / "jit" in folders and len(folders) >= 4  # builds, builds/xx, the entry, its payload
    assert {p.relative_to(root).as_posix(): oct(p.stat().st_mode & 0o777) for p in folders} == {
        p.relative_to(root).as_posix(): oct(0o700) for p in folders
    }
    writable = [p for p in root.rglob("*") if p.is_file() and p.stat().st_mode & 0o022]
    assert not writable, f"files others may write: {writable}"


def test_a_build_folder_others_may_write_is_removed_before_use(toy_backends, _isolated_cache):
    if not hasattr(os, "getuid"):
        pytest.skip("POSIX modes only")
    _tuned()
    (_isolated_cache / "builds").chmod(0o777)  # as umask 000 made it before aitune checked
    with pytest.warns(RuntimeWarning, match="builds is not yours alone"):
        model = _tuned()
    assert not model.report.graphs[0].candidates[0].from_cache
    assert (_isolated_cache / "builds").stat().st_mode & 0o777 == 0o700


def test_a_cached_build_that_fails_validation_is_evicted(toy_backends, register_plugin, _isolated_cache):
    from aitune import hookimpl
    from aitune.report import ValidationReport

    _tuned()

    class RejectCached:
        @hookimpl
        def aitune_validate(self, backend, reference, samples, graph, tolerances):
            if backend.build_info.get("from_cache"):
                return ValidationReport(passed=False, reason="stale build")
            return None

    register_plugin(RejectCached())
    with pytest.raises(ValidationError, match="stale build"):  # OneBackend raises what failed
        _tuned()
    assert not list((_isolated_cache / "builds").rglob("meta.json")), "the failing entry is still cached"
    third = _tuned()
    assert not third.report.graphs[0].candidates[0].from_cache and third.state == "tuned"


def test_a_jit_store_entry_naming_a_path_outside_it_is_forgotten(tmp_path):
    from aitune.backend import payload_file
    from aitune.errors import SerializationError

    for name in ("/etc", "../x", "a/../../b", "", 3):
        with pytest.raises(SerializationError):
            payload_file(tmp_path, name)
    assert payload_file(tmp_path, "0") == tmp_path / "0"


# -- a failed load changes nothing; numbers in the manifest are bounded -----------------------------


def _set_batch_max(value):
    def change(manifest):
        _graph(manifest)["graph"]["dims"]["batch"]["max"] = value

    return change


def _meta_device(manifest):
    for spec in _graph(manifest)["graph"]["inputs"]:
        spec["device"] = "meta"


def _hostile_config(manifest):
    _graph(manifest)["config"] = {"backend": "toy", "speed": "fast"}


@pytest.mark.parametrize(
    "attack",
    [_meta_device, _set_batch_max(2**22), _hostile_config],
    ids=["meta-device", "batch-2**22", "bad-config"],
)
def test_a_failed_load_leaves_the_model_bit_identical(saved, tmp_path, attack):
    """``load_state_dict`` used to run before the manifest's device was checked: after the
    ArtifactError the model held the artifact's weights, and a server falling back to its own model
    served someone else's. Now every check passes before anything in the model changes."""
    bad = _rewrite(saved, tmp_path / "bad.ait", attack)
    torch.manual_seed(123)  # other weights than the artifact's
    model = SlowModule(delay_s=0.0)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(ArtifactError):
        ait.load(model, bad)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert after[name].dtype == value.dtype and after[name].device == value.device
        assert torch.equal(after[name], value), f"{name} changed"
    assert not isinstance(model, ait.Module) and all(not isinstance(m, ait.Module) for m in model.modules())


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (_set_batch_max(2**22), "over the cap"),
        (_set_batch_max(1), "not 0 <= min <= opt <= max"),
        (lambda m: _graph(m)["graph"]["inputs"][0].__setitem__("shape", [2, 2**21]), "over the cap"),
        (lambda m: _graph(m)["graph"]["inputs"][0].__setitem__("dtype", "manual_seed"), "not a torch dtype"),
        (lambda m: _graph(m)["graph"]["inputs"][0].__setitem__("dims", ["nope", None]), "does not have"),
    ],
    ids=["batch-2**22", "max-below-min", "static-axis-2**21", "dtype-by-name", "unknown-range"],
)
def test_numbers_in_the_manifest_are_bounded_before_anything_is_allocated(saved, tmp_path, change, words):
    """A 17 KB artifact claiming a batch of 2**22 made ait.load allocate 4.45 GB for the refit check
    and warm-up; a graph must be consistent and its largest example under the documented cap."""
    import time
    import tracemalloc

    bad = _rewrite(saved, tmp_path / "bad.ait", change)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(ArtifactError, match=words):
            ait.load(_fresh(), bad)
        with pytest.warns(RuntimeWarning, match=words):
            model = ait.load(_fresh(), bad, fallback="eager")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert model.state == "passthrough" and time.perf_counter() - start < 30
    assert peak < 64 * 2**20, f"loading allocated {peak} bytes"
    result = verify(bad)
    assert not result["runnable_here"] and any(words in p for p in result["problems"])


# -- ait.load(check=...): an unpinned, unsigned payload is compared with eager once ------------------


def _swap_to_wrong(manifest):
    graph = _graph(manifest)
    graph["backend"], graph["config"] = "toy_wrong", {**graph["config"], "backend": "toy_wrong"}


def test_a_payload_that_disagrees_with_eager_is_refused_and_the_model_restored(saved, tmp_path):
    """A payload swapped for one that answers otherwise (here: off by 10% of the scale) loaded
    silently from an artifact nobody pinned or signed; ``check`` is on by default for those."""
    bad = _rewrite(saved, tmp_path / "bad.ait", _swap_to_wrong)
    torch.manual_seed(123)
    model = SlowModule(delay_s=0.0)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(ArtifactError, match="does not answer as eager does"):
        ait.load(model, bad)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items()), "the model was not restored"
    with pytest.warns(RuntimeWarning, match="does not answer as eager does"):
        loaded = ait.load(_fresh(), bad, fallback="eager")
    assert loaded.state == "passthrough"
    assert verify(bad)["integrity"] == "ok", "the digests cannot see it: the file is whole"


def test_check_is_off_for_a_pinned_artifact_and_can_be_asked_for(saved, tmp_path):
    import hashlib

    bad = _rewrite(saved, tmp_path / "bad.ait", _swap_to_wrong)
    pin = hashlib.sha256(bad.read_bytes()).hexdigest()
    assert ait.load(_fresh(), bad, expected_sha256=pin).state == "tuned", "the user vouched for this file"
    with pytest.raises(ArtifactError, match="does not answer as eager does"):
        ait.load(_fresh(), bad, expected_sha256=pin, check=True)
    assert ait.load(_fresh(), bad, check=False).state == "tuned"
    assert ait.load(_fresh(), saved).state == "tuned", "a faithful payload passes the check"


def test_a_model_holding_the_artifacts_weights_is_restored_without_a_copy_of_them(saved, tmp_path):
    """When the model's weights equal the artifact's, ait.load keeps no host copy for a rollback and
    puts the artifact's back (issue 56): the model is still as it was after a late failure."""
    bad = _rewrite(saved, tmp_path / "bad.ait", _swap_to_wrong)
    own = {k: v.detach().clone() for k, v in ait.load(_fresh(), saved).module.state_dict().items()}
    model = SlowModule(delay_s=0.0)
    model.load_state_dict(own)
    with warnings.catch_warnings():
        # equal weights: no "differ" warning (the edited file's own signature no longer checks: that one is said)
        warnings.filterwarnings("error", message=".*weights of .* differ")
        with pytest.raises(ArtifactError, match="does not answer as eager does"):
            ait.load(model, bad)
    after = model.state_dict()
    assert after.keys() == own.keys()
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in own.items()), "not restored"
    assert all(not isinstance(m, ait.Module) for m in model.modules())
