"""The signature inside an artifact: one file that stays vouched for wherever it is copied.

``ait.save`` signs the artifact's digest list (``SHA256SUMS``, which names every other member with
its SHA-256) with an elliptic-curve key (P-256, ECDSA over SHA-256) and stores the signature as the
member ``SIGNATURE``, written after the digest list and left out of it. A reader checks the
signature over the digest-list bytes it read, then every member against the list on the very bytes
it uses, so what was vouched for is what is parsed, with no second pass over the file.

The user's own key (:mod:`.ownkey`) signs this way; a public key given as ``trusted_keys`` checks it
too, so a colleague who holds your public key trusts the one file. ``aitune sign`` still writes the
detached OpenSSF model-signing bundle (``model.ait.sig``) for tools that read that format.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from ..errors import ArtifactError

MEMBER = "SIGNATURE"
SCHEME = "aitune-sums-ecdsa-p256-sha256/1"
MAX_BYTES = 16 * 1024
_CONTEXT = b"aitune artifact SHA256SUMS\n"
"""Signed before the digest list, so a signature made by the same key for another purpose never reads as one of these."""


_P256_SPKI = bytes.fromhex("3059301306072a8648ce3d020106082a8648ce3d030107034200")
"""The DER of a P-256 public key (SubjectPublicKeyInfo) before its 65-byte uncompressed point: fixed
for every such key, so a verifier can read one without cryptography's serialization modules (26
modules more at import, where checking a signature needs ``ec`` and ``hashes``: 14)."""


def _public_key(pem: bytes) -> Any:
    """The public key in ``pem``: a P-256 key read from its fixed DER layout (the point checked to be on
    the curve by cryptography), any other through cryptography's PEM reader; ValueError when not a key."""
    from cryptography.hazmat.primitives.asymmetric import ec

    lines = pem.strip().splitlines()
    if len(lines) >= 3 and lines[0] == b"-----BEGIN PUBLIC KEY-----" and lines[-1] == b"-----END PUBLIC KEY-----":
        try:
            der = base64.b64decode(b"".join(line.strip() for line in lines[1:-1]), validate=True)
        except ValueError:
            der = b""
        if len(der) == len(_P256_SPKI) + 65 and der.startswith(_P256_SPKI):
            return ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), der[len(_P256_SPKI) :])
    from cryptography.hazmat.primitives import serialization

    return serialization.load_pem_public_key(pem)


def key_id(public_pem: bytes) -> str:
    """A short name of a public key: the first 16 hex digits of the SHA-256 of its DER form."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_public_key(public_pem)
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()[:16]


def make(sums: bytes, private_pem: bytes, password: bytes | None = None) -> bytes:
    """The ``SIGNATURE`` member for a digest list ``sums``, signed with ``private_pem`` (an EC P-256 key)."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = serialization.load_pem_private_key(private_pem, password=password)
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ArtifactError("an artifact is signed with an elliptic-curve P-256 key (openssl ecparam -name prime256v1)")
    signature = key.sign(_CONTEXT + sums, ec.ECDSA(hashes.SHA256()))
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    record = {"scheme": SCHEME, "key": key_id(public), "signature": base64.b64encode(signature).decode()}
    return json.dumps(record, sort_keys=True).encode()


def parse(member: bytes) -> dict[str, Any]:
    """The ``SIGNATURE`` member's record, checked for shape (nothing in it is trusted yet)."""
    try:
        record = json.loads(member.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"the artifact's {MEMBER} member is not a signature record: {exc}") from exc
    if (
        not isinstance(record, dict)
        or record.get("scheme") != SCHEME
        or not isinstance(record.get("key"), str)
        or not isinstance(record.get("signature"), str)
    ):
        raise ArtifactError(f"the artifact's {MEMBER} member is not a {SCHEME} signature record")
    return record


def signer(member: bytes, sums: bytes, public_pems: Sequence[bytes]) -> int | None:
    """The index of the key in ``public_pems`` whose holder signed ``sums`` (the digest list as read),
    or None when none did (signed by another key, or the list changed since)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    record = parse(member)
    try:
        signature = base64.b64decode(record["signature"], validate=True)
    except ValueError as exc:
        raise ArtifactError(f"the artifact's {MEMBER} member holds no signature: {exc}") from exc
    for index, pem in enumerate(public_pems):
        try:
            key = _public_key(pem)
        except ValueError as exc:
            raise ArtifactError(f"a trusted key is not a PEM public key: {exc}") from exc
        if not isinstance(key, ec.EllipticCurvePublicKey):
            continue
        try:
            key.verify(signature, _CONTEXT + sums, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            continue
        return index
    return None
