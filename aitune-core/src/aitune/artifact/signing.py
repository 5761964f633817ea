"""Signing an artifact and checking its signature, with the OpenSSF ``model-signing`` library.

The digests inside an artifact catch corruption, not tampering: whoever can edit the file can
re-sum it. A signature made with a private key the user keeps, checked against the public key the
user trusts, can only come from that key's holder. aitune signs the whole ``.ait`` file (an
elliptic-curve key pair, offline; or a certificate and its chain) into a detached Sigstore bundle
beside it, ``model.ait.sig``, which ``model_signing`` itself verifies.

``model-signing`` is imported only here, on use: ``pip install 'aitune-core[signing]'``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ArtifactError, ConfigError
from ..text import clip
from .archive import FILE_MODE, umask

SUFFIX = ".sig"


def signature_path(artifact: Path, signature: str | Path | None = None) -> Path:
    """Where an artifact's signature is: ``signature``, else ``<artifact>.sig`` beside it."""
    return Path(signature) if signature is not None else artifact.with_name(artifact.name + SUFFIX)


def _library() -> Any:
    try:
        import model_signing
    except ImportError as exc:
        raise ConfigError(
            "signing and checking artifact signatures needs the OpenSSF model-signing library: "
            f"pip install 'aitune-core[signing]' ({type(exc).__name__}: {exc})"
        ) from exc
    return model_signing


def sign(
    artifact: str | Path,
    key: str | Path,
    *,
    certificate: str | Path | None = None,
    chain: Sequence[str | Path] = (),
    signature: str | Path | None = None,
    password: str | None = None,
) -> Path:
    """Sign ``artifact`` with the private ``key`` (PEM); returns the signature's path.

    With ``certificate`` (and its ``chain``) the signature carries the signing certificate, for
    users who trust a certificate authority rather than one public key.
    """
    artifact = Path(artifact)
    if not artifact.is_file():
        raise ArtifactError(f"no artifact at {artifact} to sign")
    out = signature_path(artifact, signature)
    config = _library().signing.Config()
    if certificate is not None:
        config = config.use_certificate_signer(
            private_key=key, signing_certificate=certificate, certificate_chain=chain
        )
    else:
        config = config.use_elliptic_key_signer(private_key=key, password=password)
    # written beside the target and renamed onto it: a planted symlink at ``out`` is replaced, never followed
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        config.sign(artifact, Path(tmp))
        os.chmod(tmp, FILE_MODE & ~umask())  # a signature is public, writable by its owner alone: 0644 at most
        os.replace(tmp, out)
    except Exception as exc:
        raise ArtifactError(f"{artifact} could not be signed with {key}: {type(exc).__name__}: {exc}") from exc
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out


def verify_signature(
    artifact: str | Path,
    trusted_keys: Sequence[str | Path] = (),
    *,
    certificate_chain: Sequence[str | Path] = (),
    signature: str | Path | None = None,
    content: Path | None = None,
) -> str:
    """Check that ``artifact`` is signed by one of ``trusted_keys`` (public keys, PEM) or by a
    certificate that chains to ``certificate_chain``; returns what signed it, or raises ArtifactError.

    ``content`` is where the bytes to check are read when they are not read at ``artifact`` itself:
    the reader's own open file (``Reader.content_path``), so what is checked is what is loaded.
    """
    artifact = Path(artifact)
    sig = signature_path(artifact, signature)
    if not sig.is_file():
        raise ArtifactError(
            f"{artifact} has no signature at {sig}: a signed artifact travels with its .sig file "
            "(aitune sign makes one); without it, pin the file with expected_sha256 instead"
        )
    if not trusted_keys and not certificate_chain:
        raise ConfigError("checking a signature needs trusted_keys (public keys) or a certificate_chain")
    library = _library()
    target = content if content is not None else artifact

    def verifying() -> Any:
        # the whole file's SHA-256, as aitune sign (and model-signing by default) signs it; content
        # may be a link to the open file (/proc/self/fd/N), which the default config refuses to follow
        hashing = library.hashing.Config().use_file_serialization(hashing_algorithm="sha256").set_allow_symlinks(True)
        return library.verifying.Config().set_hashing_config(hashing)

    failures = []
    for key in trusted_keys:
        config = verifying().use_elliptic_key_verifier(public_key=key)
        try:
            config.verify(target, sig)
            return f"signed by the key {Path(key).name}"
        except Exception as exc:
            failures.append(f"{Path(key).name}: {type(exc).__name__}: {clip(str(exc), 200)}")
    if certificate_chain:
        config = verifying().use_certificate_verifier(certificate_chain=certificate_chain)
        try:
            config.verify(target, sig)
            return "signed by a certificate of the trusted chain"
        except Exception as exc:
            failures.append(f"certificate chain: {type(exc).__name__}: {clip(str(exc), 200)}")
    raise ArtifactError(
        f"{artifact} is not signed by a key you trust, or was changed after signing ({'; '.join(failures)}); "
        "get the artifact and its .sig again from their source"
    )
