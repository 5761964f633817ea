"""Each artifact member is hashed once when loading, on the bytes used (issue 56): what makes that safe."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from aitune.artifact import seal
from aitune.artifact.archive import Reader, Writer
from aitune.artifact.reader import _compare_weights
from aitune.errors import ArtifactError, ArtifactIntegrityError

PAYLOAD = b"payload bytes " * 100
WEIGHTS = b"the saved weights"


def _archive(path: Path) -> Path:
    writer = Writer(path)
    writer.add_bytes("weights.safetensors", WEIGHTS)
    writer.add_bytes("payload/0/model.bin", PAYLOAD)
    writer.commit()
    return path


def _flip(path: Path, needle: bytes) -> None:
    """Change one byte of ``needle`` in the file, in place (the same inode, as a writer holding it would)."""
    data = path.read_bytes()
    at = data.index(needle)
    with open(path, "r+b") as file:
        file.seek(at)
        file.write(bytes([data[at] ^ 1]))


def test_a_tampered_payload_is_refused_while_it_is_copied_out(tmp_path: Path) -> None:
    path = _flip_after(_archive(tmp_path / "m.ait"))
    reader = Reader(path)
    try:
        with pytest.raises(ArtifactIntegrityError, match="payload/0/model.bin"):
            reader.verify_all(extract={"payload/0": [tmp_path / "out"]})
    finally:
        reader.close()


def _flip_after(path: Path) -> Path:
    _flip(path, PAYLOAD)
    return path


def test_the_copied_payload_is_the_checked_one_whatever_the_file_becomes(tmp_path: Path) -> None:
    path = _archive(tmp_path / "m.ait")
    reader = Reader(path)
    try:
        reader.verify_all(extract={"payload/0": [tmp_path / "a", tmp_path / "b"]})
        _flip(path, PAYLOAD)  # changed after the check: the runtime opens the copy, not the file
        assert (tmp_path / "a" / "model.bin").read_bytes() == PAYLOAD
        assert (tmp_path / "b" / "model.bin").read_bytes() == PAYLOAD
    finally:
        reader.close()


def test_a_member_read_is_not_hashed_again_but_every_other_one_is(tmp_path: Path) -> None:
    path = _archive(tmp_path / "m.ait")
    _flip(path, PAYLOAD)
    reader = Reader(path)
    try:
        assert reader.read("weights.safetensors") == WEIGHTS  # checked on the bytes handed out
        with pytest.raises(ArtifactIntegrityError, match="payload/0/model.bin"):
            reader.verify_all()
    finally:
        reader.close()
    path = _archive(tmp_path / "t.ait")
    _flip(path, WEIGHTS)
    tampered = Reader(path)
    try:
        with pytest.raises(ArtifactIntegrityError, match="weights.safetensors"):
            tampered.read("weights.safetensors")
        with pytest.raises(ArtifactIntegrityError, match="weights.safetensors"):
            tampered.verify_all()  # a read that failed checked nothing
    finally:
        tampered.close()


def test_weights_are_the_same_only_with_every_name_dtype_and_value() -> None:
    module = torch.nn.Linear(3, 2)
    own = {k: v.detach().clone() for k, v in module.state_dict().items()}
    assert _compare_weights(module, own) == "same"
    assert _compare_weights(module, {**own, "weight": own["weight"] + 1}) != "same"
    assert _compare_weights(module, {**own, "weight": own["weight"].double()}) != "same"
    assert _compare_weights(module, {"weight": own["weight"]}) != "same"


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def test_a_p256_key_read_without_serialization_verifies_as_the_full_reader_does() -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    other = ec.generate_private_key(ec.SECP384R1())
    sums = b"0" * 64 + b"  manifest.json\n"
    signature = key.sign(seal._CONTEXT + sums, ec.ECDSA(hashes.SHA256()))
    member = b'{"key": "k", "scheme": "%s", "signature": "%s"}' % (seal.SCHEME.encode(), base64.b64encode(signature))
    assert seal._public_key(_pem(key)).public_numbers() == key.public_key().public_numbers()
    assert seal.signer(member, sums, [_pem(other), _pem(key)]) == 1  # a P-384 key goes through the full reader
    assert seal.signer(member, sums + b"x", [_pem(key)]) is None
    der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    off_curve = der[:-1] + bytes([der[-1] ^ 1])
    pem = b"-----BEGIN PUBLIC KEY-----\n" + base64.b64encode(off_curve) + b"\n-----END PUBLIC KEY-----\n"
    with pytest.raises(ArtifactError, match="not a PEM public key"):
        seal.signer(member, sums, [pem])


def test_reading_a_p256_key_imports_no_serialization_package(tmp_path: Path) -> None:
    (tmp_path / "key.pem").write_bytes(_pem(ec.generate_private_key(ec.SECP256R1())))
    code = (
        "import sys\nfrom pathlib import Path\nfrom aitune.artifact import seal\n"
        f"seal._public_key(Path({str(tmp_path / 'key.pem')!r}).read_bytes())\n"
        "print(sorted(m for m in sys.modules if m.startswith('cryptography.hazmat.primitives.serialization')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_members_larger_than_a_read_block_and_empty_ones_read_back_whole(tmp_path: Path) -> None:
    """Members are read by position in 1 MiB blocks: one of 2.5 MiB comes back whole, read and
    extracted, and an empty one reads as empty."""
    big = bytes(range(256)) * (10 * 1024 + 7)  # 2.5 MiB and a bit: three blocks, the last one short
    writer = Writer(tmp_path / "m.ait")
    writer.add_bytes("empty.txt", b"")
    writer.add_bytes("payload/0/model.bin", big)
    writer.add_bytes("weights.safetensors", big[::-1])
    writer.commit()
    reader = Reader(tmp_path / "m.ait")
    try:
        assert reader.read("weights.safetensors") == big[::-1]
        assert reader.read("empty.txt") == b""
        reader.verify_all(extract={"payload/0": [tmp_path / "out"]})
        assert (tmp_path / "out" / "model.bin").read_bytes() == big
    finally:
        reader.close()
