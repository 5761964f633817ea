"""The user's own signing key: what a user saves loads back for that user with no flag.

``ait.save`` signs each artifact with a key pair aitune makes on first use in the user's config
folder (``AITUNE_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/aitune``, else ``~/.config/aitune``), in
``signing/key.pem`` (the private key, 0600) and ``signing/key.pub.pem``; ``ait.load`` trusts that
public key by default. An artifact from anyone else still needs a pin, a trusted key or
``trust_native_code=True``. ``AITUNE_OWN_KEY=0`` turns both off (``ait.save(..., sign=False)``
for one save).

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

FOLDER = "signing"
PRIVATE = "key.pem"
PUBLIC = "key.pub.pem"
_OFF = {"0", "false", "no", "off"}


@attrs.frozen
class OwnKey:
    private: Path
    public: Path


def enabled() -> bool:
    return off_reason() is None


def off_reason() -> str | None:
    """Why aitune neither signs with nor trusts the user's own key, or None when it does."""
    if os.environ.get("AITUNE_OWN_KEY", "1").strip().lower() in _OFF:
        return "AITUNE_OWN_KEY is off"
    try:
        import model_signing  # noqa: F401
    except ImportError:
        return "model-signing is not installed (pip install 'aitune-core[signing]')"
    return None


def config_dir() -> Path:
    """``AITUNE_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/aitune``, else ``~/.config/aitune`` (not created here)."""
    explicit = os.environ.get("AITUNE_CONFIG_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "aitune"


def existing() -> OwnKey | None:
    """The user's key pair, if aitune made one and it is the user's alone; None otherwise (warned)."""
    folder = config_dir() / FOLDER
    key = OwnKey(folder / PRIVATE, folder / PUBLIC)
    if not os.path.lexists(folder):
        return None
    problem = None if key.private.is_file() and key.public.is_file() else "the key pair in it is incomplete"
    problem = problem or _not_private(key)
    if problem:
        warnings.warn(
            f"aitune does not use your signing key in {folder}: {problem} (a key others may write or read could sign "
            f"or vouch for their artifacts). Delete {folder}: aitune makes a new key on the next save; or set "
            "AITUNE_CONFIG_DIR to a folder of your own",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return key


def get_or_create() -> OwnKey | None:
    """The user's key pair, made on first use (0700 folder, 0600 private key); None if it cannot be used."""
    found = existing()
    if found is not None or os.path.lexists(config_dir() / FOLDER):
        return found  # None: warned by existing()
    root = config_dir()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
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


def _not_private(key: OwnKey) -> str | None:
    """Why the key pair or its folders are not the user's alone, or None."""
    if not hasattr(os, "getuid"):  # no POSIX owners: the folder's ACL decides
        return None
    for path in (key.private.parent.parent, key.private.parent, key.public):
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            return f"{path} is a symbolic link"
        if info.st_uid != os.getuid():
            return f"{path} belongs to user id {info.st_uid}, not to you ({os.getuid()})"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"others may write {path} (mode {stat.S_IMODE(info.st_mode):o})"
    info = os.lstat(key.private)
    if stat.S_ISLNK(info.st_mode) or info.st_uid != os.getuid():
        return f"{key.private} is a link or not yours"
    if info.st_mode & 0o077:
        return f"others may read the private key {key.private} (mode {stat.S_IMODE(info.st_mode):o})"
    return None
