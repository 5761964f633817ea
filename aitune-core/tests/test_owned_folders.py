"""A payload's private folder (``aitune.files.owned_folder``): removed with its owner, and reclaimed by
the next process when the one that made it was killed outright (SIGKILL, as the OOM killer or Ray
stopping a replica sends), never while its process lives, and never anything but this user's own."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from aitune import files

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock: nothing is reclaimed on Windows")

CHILD = textwrap.dedent(
    """
    import sys
    from aitune.files import owned_folder
    class Owner: pass
    owner = Owner()
    print(owned_folder(sys.argv[1], owner), flush=True)
    sys.stdin.readline()  # held until told, or killed
    """
)


@pytest.fixture
def prefix() -> str:
    """A prefix no other folder in the temporary folder has."""
    return f"aitune-test-owned-{uuid.uuid4().hex[:8]}-"


def _child(prefix: str) -> tuple[subprocess.Popen[str], Path]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, prefix], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    return child, Path(child.stdout.readline().strip())


def _reclaim(prefix: str) -> None:
    """What the next process's first ``owned_folder`` of this prefix does."""
    files._RECLAIMED.discard(prefix)
    files._reclaim(prefix)


def test_the_folder_is_private_and_goes_with_its_owner(prefix):
    class Owner:
        pass

    owner = Owner()
    folder = files.owned_folder(prefix, owner)
    assert folder.is_dir() and folder.name.startswith(prefix) and (folder / files.OWNER_FILE).is_file()
    assert folder.stat().st_mode & 0o777 == 0o700
    (folder / "model.onnx").write_bytes(b"x")
    del owner
    gc.collect()
    assert not folder.exists()


def test_a_killed_process_s_folder_is_reclaimed_and_a_living_one_s_is_not(prefix):
    living, kept = _child(prefix)
    killed, left = _child(prefix)
    try:
        (left / "model.onnx").write_bytes(b"x" * 1024)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        assert left.is_dir(), "SIGKILL runs no finalizer: the folder stays until someone reclaims it"
        _reclaim(prefix)
        assert not left.exists() and kept.is_dir()
    finally:
        living.communicate("\n", timeout=30)
    assert living.returncode == 0 and not kept.exists()  # its own exit removed it


def test_only_this_user_s_plain_folders_with_an_unlocked_owner_file_are_reclaimed(prefix, tmp_path):
    root = Path(tempfile.gettempdir())
    unowned = root / f"{prefix}unowned"
    unowned.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / files.OWNER_FILE).write_text("")
    link = root / f"{prefix}link"
    link.symlink_to(elsewhere, target_is_directory=True)
    foreign = root / f"{prefix}foreign"
    foreign.mkdir()
    (foreign / files.OWNER_FILE).write_text("")  # its lock is free: were it ours, it would go
    try:
        os.chown(foreign, 54321, 54321)  # as another account's (root can make it so; others cannot)
        chowned = True
    except PermissionError:
        chowned = False
        foreign.rename(root / f"other-{foreign.name}")  # out of the way: not ours to test here
    try:
        _reclaim(prefix)
        assert unowned.is_dir(), "no owner file: another aitune's, or one being made"
        assert link.is_symlink() and elsewhere.is_dir(), "a link is followed nowhere"
        assert foreign.is_dir() or not chowned, "another account's folder is not ours to remove"
    finally:
        link.unlink()
        unowned.rmdir()
        for left in (foreign, root / f"other-{foreign.name}"):
            if left.exists():
                (left / files.OWNER_FILE).unlink()
                left.rmdir()
