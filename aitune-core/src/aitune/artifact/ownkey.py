"""The user's own signing key: what a user saves loads back for that user with no flag.

``ait.save`` signs each artifact with a key pair aitune makes on first use in the user's config
folder (``AITUNE_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/aitune``, else ``~/.config/aitune``), in
``signing/key.pem`` (the private key, 0600) and ``signing/key.pub.pem``; ``ait.load`` trusts that
public key by default. The signature travels inside the artifact (:mod:`.seal`), so a copied
``.ait`` stays vouched for. An artifact from anyone else still needs a pin, a trusted key or
``trust_native_code=True``. ``AITUNE_OWN_KEY=0`` turns both off (``ait.save(..., sign=False)``
for one save). With no home folder there is no key (:mod:`aitune.envvars`).

Whoever can write the folder could put their public key in it, and whoever can read the private
key can sign as the user: a folder or key that is not the user's alone is not used (with a warning).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import warnings
from pathlib import Path

import attrs

from ..envvars import CONFIG_DIR, OWN_KEY, config_base
from ..files import make_folders

FOLDER = "signing"
PRIVATE = "key.pem"
PUBLIC = "key.pub.pem"
MAX_KEY_BYTES = 64 * 1024
"""A PEM key is a few hundred bytes: anything larger in the key folder is not aitune's key."""


@attrs.frozen
class OwnKey:
    """The user's key pair as read, once, through the key folder's descriptor."""

    folder: Path
    private_pem: bytes = attrs.field(repr=False)
    public_pem: bytes

    @property
    def public(self) -> Path:
        """Where the public key lies (to hand out to colleagues); what was read is :attr:`public_pem`."""
        return self.folder / PUBLIC


def enabled() -> bool:
    return off_reason() is None


def off_reason() -> str | None:
    """Why aitune neither signs with nor trusts the user's own key, or None when it does."""
    if not OWN_KEY.get():
        return "AITUNE_OWN_KEY is off"
    if config_dir() is None:
        return "there is no home folder to keep a key in (set HOME or AITUNE_CONFIG_DIR)"
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return "the cryptography library is not installed (pip install cryptography)"
    return None


def config_dir() -> Path | None:
    """``AITUNE_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/aitune``, else ``~/.config/aitune`` (not created
    here); None with no home folder."""
    explicit = CONFIG_DIR.get()
    if explicit is not None:
        return explicit
    base = config_base()
    return None if base is None else base / "aitune"


def existing() -> OwnKey | None:
    """The user's key pair, if aitune made one and it is the user's alone; None otherwise (warned).

    The key folder is opened once without following links and checked on that descriptor (owner,
    mode); each key is opened relative to it, without following links, and checked again on its own
    descriptor: a folder or file swapped in by path after a check is never what is read."""
    root = config_dir()
    if root is None:
        return None
    folder = root / FOLDER
    if not os.path.lexists(folder):
        return None
    try:
        problem = _not_private(root)
        key = None if problem else _read_pair(folder)
    except _NotPrivate as exc:
        problem, key = str(exc), None
    if key is None:
        warnings.warn(
            f"aitune does not use your signing key in {folder}: {problem} (a key others may write or read could sign "
            f"or vouch for their artifacts). Delete {folder}: aitune makes a new key on the next save; or set "
            "AITUNE_CONFIG_DIR to a folder of your own",
            RuntimeWarning,
            stacklevel=3,
        )
    return key


def get_or_create() -> OwnKey | None:
    """The user's key pair, made on first use (0700 folders, 0600 private key); None if it cannot be used."""
    root = config_dir()
    if root is None:
        return None
    found = existing()
    if found is not None or os.path.lexists(root / FOLDER):
        return found  # None: warned by existing()
    make_folders(root, "config")
    staging = Path(tempfile.mkdtemp(prefix=".signing-", dir=root))  # 0700 whatever the umask
    try:
        _write_pair(staging)
        os.rename(staging, root / FOLDER)  # atomic; fails if another process made the key first
    except OSError:
        if not os.path.lexists(root / FOLDER):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return existing()


def _write_pair(folder: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    for name, data in ((PRIVATE, private), (PUBLIC, public)):
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)


class _NotPrivate(Exception):
    """Why the key folder or a key in it is not the user's alone."""


def _not_private(root: Path) -> str | None:
    """Why the config folder holding the key is not the user's alone, or None."""
    if not hasattr(os, "getuid"):  # no POSIX owners: the folder's ACL decides
        return None
    info = os.lstat(root)
    if stat.S_ISLNK(info.st_mode):
        return f"{root} is a symbolic link"
    return _foreign(info, root)


def _foreign(info: os.stat_result, path: Path, secret: bool = False) -> str | None:
    if not hasattr(os, "getuid"):
        return None
    if info.st_uid != os.getuid():
        return f"{path} belongs to user id {info.st_uid}, not to you ({os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others may write {path} (mode {stat.S_IMODE(info.st_mode):o})"
    if secret and info.st_mode & 0o077:
        return f"others may read the private key {path} (mode {stat.S_IMODE(info.st_mode):o})"
    return None


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _read_pair(folder: Path) -> OwnKey:
    """Both keys, read through one descriptor of ``folder`` (see :func:`existing`); raises _NotPrivate."""
    try:
        dir_fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW)
    except OSError as exc:
        raise _NotPrivate(f"{folder} cannot be opened as a folder without following links ({exc.strerror})") from exc
    try:
        problem = _foreign(os.fstat(dir_fd), folder)
        if problem:
            raise _NotPrivate(problem)
        private = _read_key(dir_fd, folder / PRIVATE, secret=True)
        public = _read_key(dir_fd, folder / PUBLIC)
    finally:
        os.close(dir_fd)
    return OwnKey(folder, private, public)


def _read_key(dir_fd: int, path: Path, secret: bool = False) -> bytes:
    try:
        fd = os.open(path.name, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=dir_fd)
    except FileNotFoundError as exc:
        raise _NotPrivate("the key pair in it is incomplete") from exc
    except OSError as exc:
        raise _NotPrivate(f"{path} cannot be opened without following links ({exc.strerror})") from exc
    with os.fdopen(fd, "rb") as file:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise _NotPrivate(f"{path} is not a regular file")
        problem = _foreign(before, path, secret)
        if problem:
            raise _NotPrivate(problem)
        data = file.read(MAX_KEY_BYTES + 1)
        after = os.fstat(fd)
    if len(data) > MAX_KEY_BYTES or (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise _NotPrivate(f"{path} is larger than a key or changed while it was read")
    return data
