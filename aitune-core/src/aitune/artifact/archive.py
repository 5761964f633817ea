"""Reading and writing the zip container, safely.

Writing goes to a temporary file beside the target that is renamed into place, so a crash never
leaves half an artifact. Reading refuses, before any runtime sees a byte: member paths that
escape (absolute, ``..``, backslashes), duplicates, members missing from or not listed in the
``SHA256SUMS`` member, digests that differ, oversized manifests and a whole-file digest that
differs from ``expected_sha256``.

The file is opened once (:func:`open_once`): the pin, the signature and every read go through that
one open, so replacing the file at its path after the check changes nothing that is read. A file
whose whole-file hash vouches for it (a pin, a detached signature) is copied into a private unnamed
file while it is hashed, so the bytes hashed are the bytes parsed even if someone still holds a
descriptor that writes the original. The signature inside the file (:mod:`.seal`) needs no copy:
it covers the digest list, and every member is checked against that list on the bytes used.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import IO, Any

from ..cachedir import file_sha256
from ..errors import ArtifactError, ArtifactIntegrityError
from . import seal

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SUMS = "SHA256SUMS"
REPORT = "report.json"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
_CHUNK = 1 << 20
_SAFE = re.compile(r"^[A-Za-z0-9._\-]+$")
FILE_MODE = 0o644
"""The most a file aitune saves is opened to: its owner writes it, others read it."""


def check_member_name(name: str) -> None:
    """A member name is plain relative segments: ``a/./b`` and ``a//b`` are refused, since they name
    the same file as ``a/b`` and would slip past the duplicate check."""
    path = PurePosixPath(name)
    if name.startswith("/") or "\\" in name or path.is_absolute() or ".." in path.parts or not path.parts:
        raise ArtifactIntegrityError(f"artifact member {name!r} escapes the archive; the file is corrupt or hostile")
    if name.split("/") != list(path.parts):
        raise ArtifactIntegrityError(
            f"artifact member {name!r} is not written plainly (an empty or '.' segment); the file is corrupt or hostile"
        )
    if not all(_SAFE.match(part) for part in path.parts):
        raise ArtifactIntegrityError(f"artifact member {name!r} has an unexpected name; the file is corrupt or hostile")


def umask() -> int:
    """The process umask; read from /proc where possible, since os.umask can only read it by setting it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class Writer:
    """Collects members, then writes the archive atomically with its digest list."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.digests: dict[str, str] = {}
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        self.tmp = Path(tmp)
        self.zip = zipfile.ZipFile(self.tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True)

    def add_file(self, name: str, source: Path) -> None:
        check_member_name(name)
        self.digests[name] = file_sha256(source)
        self.zip.write(source, name)

    def add_bytes(self, name: str, data: bytes) -> None:
        check_member_name(name)
        self.digests[name] = hashlib.sha256(data).hexdigest()
        self.zip.writestr(name, data)

    def commit(self, sign: Callable[[bytes], bytes] | None = None) -> None:
        """Write the digest list, then (with ``sign``) the signature over it (:mod:`.seal`), and
        rename the file into place, readable by others and writable by its owner alone (0644 at
        most, whatever the umask: a file others may write could be rewritten in place)."""
        sums = "".join(f"{digest}  {name}\n" for name, digest in sorted(self.digests.items())).encode()
        self.zip.writestr(SUMS, sums)
        if sign is not None:
            self.zip.writestr(seal.MEMBER, sign(sums))
        self.zip.close()
        with open(self.tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(self.tmp, FILE_MODE & ~umask())  # mkstemp made it 0600; a saved file gets the usual mode
        os.replace(self.tmp, self.target)

    def abort(self) -> None:
        try:
            self.zip.close()
        finally:
            self.tmp.unlink(missing_ok=True)


class Reader:
    """An opened, structurally checked archive whose members are verified as they are read."""

    def __init__(self, path: Path, expected_sha256: str | None = None, *, private: bool = False) -> None:
        """``private``: copy the file into a private unnamed file while hashing it (see :func:`open_once`),
        as a detached signature over the whole file is checked; a pin always does."""
        self.path = path
        self.verified = False
        self._checked: set[str] = set()
        self.file, self._sha256 = open_once(path, private=private or expected_sha256 is not None)
        self._scratch: tempfile.TemporaryDirectory[str] | None = None
        try:
            self._open(expected_sha256)
        except BaseException:
            self.close()
            raise

    def _open(self, expected_sha256: str | None) -> None:
        path = self.path
        if expected_sha256 is not None:
            actual = self.sha256()
            if actual.lower() != expected_sha256.lower():
                raise ArtifactIntegrityError(
                    f"{path} has SHA-256 {actual}, not the expected {expected_sha256}: it was changed or is "
                    "another file; get the artifact again from its source"
                )
        try:
            self.zip = zipfile.ZipFile(self.file)
            infos = self.zip.infolist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError) as exc:  # NotImplementedError too
            raise ArtifactError(f"{path} is not a readable .ait artifact (truncated or corrupt): {exc}") from exc
        size = os.fstat(self.file.fileno()).st_size
        names = [i.filename for i in infos]
        if len(set(names)) != len(names):
            raise ArtifactError(f"{path} holds duplicate members; the file is corrupt or hostile")
        for info in infos:
            check_member_name(info.filename)
            if info.is_dir():
                raise ArtifactError(f"{path}: unexpected folder entry {info.filename!r}")
            # aitune writes members uncompressed, so no member can be larger than the file: this
            # refuses zip bombs before a byte is inflated
            if (
                info.compress_type != zipfile.ZIP_STORED
                or info.file_size != info.compress_size
                or info.file_size > size
            ):
                raise ArtifactError(
                    f"{path}: member {info.filename!r} is compressed or larger than the file; aitune writes "
                    "uncompressed members, so the file was altered or is not an aitune artifact"
                )
        self._check_layout(infos, size)
        self.infos = {i.filename: i for i in infos}
        if SUMS not in self.infos:
            raise ArtifactError(f"{path} has no {SUMS} member: it is not an aitune artifact or it is truncated")
        self.digests = self._read_sums()
        self.seal = self._read_seal()
        # the signature is not in the list it signs; a list that names it anyway was re-summed by a
        # hand that did not sign it, and the signature over it no longer checks
        listed, present = set(self.digests) - {seal.MEMBER}, set(self.infos) - {SUMS, seal.MEMBER}
        if listed != present:
            extra, missing = sorted(present - listed), sorted(listed - present)
            raise ArtifactError(
                f"{path} does not match its digest list (unlisted: {extra[:5]}, missing: {missing[:5]}); "
                "the file was altered or truncated"
            )

    def _check_layout(self, infos: list[zipfile.ZipInfo], size: int) -> None:
        """Members one after the other, as aitune writes them: no member's bytes inside another's.

        Overlapping entries let a small file list many large members that share the same bytes (a
        4 MB file read as gigabytes); all of them together can be no larger than the file.
        """
        if sum(i.file_size for i in infos) > size:
            raise ArtifactError(f"{self.path}: its members add up to more than the file; it is corrupt or hostile")
        end = 0
        fp = self.zip.fp
        self._spans: dict[str, tuple[int, int]] = {}
        for info in infos:
            if info.flag_bits & 0x08 or info.header_offset < end:
                raise ArtifactError(
                    f"{self.path}: member {info.filename!r} overlaps the one before it or is not laid out in order; "
                    "aitune writes members one after the other, so the file was altered"
                )
            if fp is None:
                raise ArtifactError(f"{self.path}: cannot be read")
            fp.seek(info.header_offset)
            header = fp.read(30)
            if len(header) != 30 or header[:4] != b"PK\x03\x04":
                raise ArtifactError(f"{self.path}: member {info.filename!r} has no local header; the file is corrupt")
            name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
            start = info.header_offset + 30 + name_len + extra_len
            self._spans[info.filename] = (start, info.file_size)
            end = start + info.compress_size
        if end > getattr(self.zip, "start_dir", size):
            raise ArtifactError(f"{self.path}: the last member runs into the directory; the file is corrupt or hostile")

    def _read_seal(self) -> bytes | None:
        """The signature inside the file (:mod:`.seal`), as read once; None when it has none."""
        info = self.infos.get(seal.MEMBER)
        if info is None:
            return None
        if info.file_size > seal.MAX_BYTES:
            raise ArtifactError(f"{self.path}: the signature member is implausibly large ({info.file_size} bytes)")
        return self._raw(seal.MEMBER)

    def _read_sums(self) -> dict[str, str]:
        info = self.infos[SUMS]
        if info.file_size > MAX_MANIFEST_BYTES:
            raise ArtifactError(f"{self.path}: the digest list is implausibly large ({info.file_size} bytes)")
        self.sums = self._raw(SUMS)
        """The digest list's bytes as read: what a signature inside the file is checked over."""
        try:
            text = self.sums.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ArtifactError(f"{self.path}: the digest list is not text") from exc
        out: dict[str, str] = {}
        for line in text.splitlines():
            digest, sep, name = line.partition("  ")
            if not sep or not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ArtifactError(f"{self.path}: malformed digest line {line[:80]!r}")
            check_member_name(name)
            out[name] = digest
        return out

    def _raw(self, name: str) -> bytes:
        # one block of the member's size: one read (the kernel returns at most 2 GiB a read, the rest
        # follows), and joining a single block returns it without a copy
        return b"".join(self._blocks(name, max(self._spans[name][1], 1)))

    def _blocks(self, name: str, block: int = _CHUNK) -> Iterator[bytes]:
        """Member ``name``'s bytes, ``block`` bytes at a time, read where the layout check found them.

        Read by position, not through ``zipfile``: every member is stored (checked when opened), and
        the SHA-256 each read is checked against already covers what zip's CRC-32 would, so the bytes
        are not passed over twice."""
        start, size = self._spans[name]
        done = 0
        while done < size:
            try:
                data = self._read_at(start + done, min(block, size - done))
            except OSError as exc:
                raise ArtifactIntegrityError(f"{self.path}: member {name!r} cannot be read: {exc}") from exc
            if not data:
                raise ArtifactIntegrityError(f"{self.path}: member {name!r} is cut short; the file is truncated")
            done += len(data)
            yield data

    def _read_at(self, offset: int, size: int) -> bytes:
        if hasattr(os, "pread"):  # leaves the file's position to zipfile
            return os.pread(self.file.fileno(), size, offset)
        self.file.seek(offset)
        return self.file.read(size)

    def read(self, name: str, limit: int | None = None) -> bytes:
        """A member's bytes, after checking its digest."""
        if name not in self.infos or name == SUMS:
            raise ArtifactError(f"{self.path} has no member {name!r}")
        if limit is not None and self.infos[name].file_size > limit:
            raise ArtifactError(
                f"{self.path}: member {name!r} is implausibly large ({self.infos[name].file_size} bytes)"
            )
        data = self._raw(name)
        if hashlib.sha256(data).hexdigest() != self.digests[name]:
            raise ArtifactIntegrityError(
                f"{self.path}: member {name!r} does not match its SHA-256; the file was altered"
            )
        self._checked.add(name)  # these very bytes were checked: verify_all need not hash the member again
        return data

    def verify_all(self, extract: Mapping[str, Sequence[Path]] | None = None) -> None:
        """Check the digest of every member, streaming, so a large payload is never held in memory;
        a member :meth:`read` already checked on the bytes it handed out is not hashed again.

        ``extract``: members under ``<prefix>/`` are written, as they are hashed, into each of the
        new private folders given for that prefix (a payload's files, for a runtime that opens
        paths): the bytes checked are the bytes written, in a folder nobody else may write, so the
        copy needs no second check. A member that fails its digest raises; what was written of it
        stays in the caller's folder, which the caller removes unused.
        """
        targets = dict(extract or {})
        for folders in targets.values():
            for folder in folders:
                folder.mkdir()
        for name in self.digests:
            sinks = [
                folder / name[len(prefix) + 1 :]
                for prefix, folders in targets.items()
                if name.startswith(prefix + "/")
                for folder in folders
            ]
            if not sinks:
                if name not in self._checked:
                    self._stream_checked(name, lambda block: None)
                continue
            with contextlib.ExitStack() as stack:
                outs: list[IO[bytes]] = []
                for dest in sinks:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    outs.append(stack.enter_context(open(dest, "xb")))
                self._stream_checked(name, _writer(outs))
        self.verified = True

    def _stream_checked(self, name: str, sink: Callable[[bytes], Any]) -> None:
        """Hand member ``name`` to ``sink`` block by block; its digest must match the sums file."""
        digest = hashlib.sha256()
        for block in self._blocks(name):
            digest.update(block)
            sink(block)
        if digest.hexdigest() != self.digests[name]:
            raise ArtifactIntegrityError(
                f"{self.path}: member {name!r} does not match its SHA-256; the file was altered"
            )

    def sha256(self) -> str:
        """SHA-256 of the whole file as this reader opened it (computed while copying, where it was copied)."""
        if self._sha256 is not None:
            return self._sha256
        digest = hashlib.sha256()
        self.file.seek(0)
        for block in iter(lambda: self.file.read(_CHUNK), b""):
            digest.update(block)
        self.file.seek(0)
        return digest.hexdigest()

    def content_path(self) -> Path:
        """A path whose bytes are this reader's open file, for a library that reads paths (signature checks).

        ``/proc/self/fd/N`` reopens the very file this reader holds, whatever is at :attr:`path` now;
        without ``/proc``, a private copy made from the open file.
        """
        fd = self.file.fileno()
        proc = Path(f"/proc/self/fd/{fd}")
        try:
            mine, there = os.fstat(fd), os.stat(proc)
            if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
                return proc
        except OSError:
            pass
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="aitune-verify-")
            copy = Path(self._scratch.name) / self.path.name
            with open(copy, "wb") as out:
                self.file.seek(0)
                shutil.copyfileobj(self.file, out, _CHUNK)
                self.file.seek(0)
        return Path(self._scratch.name) / self.path.name

    def close(self) -> None:
        zip_file = getattr(self, "zip", None)
        if zip_file is not None:
            zip_file.close()
        self.file.close()
        if self._scratch is not None:
            self._scratch.cleanup()


def _writer(outs: Sequence[IO[bytes]]) -> Callable[[bytes], None]:
    """A sink that writes each block into every one of ``outs``."""

    def write(block: bytes) -> None:
        for out in outs:
            out.write(block)

    return write


def open_once(path: Path, *, private: bool = False) -> tuple[IO[bytes], str | None]:
    """The artifact's one open, which every check and read of a :class:`Reader` goes through, and
    the whole file's SHA-256 when it was copied (else None).

    The file is copied into a private unnamed file, hashed on the way, when its whole-file hash
    vouches for it (``private``: a pin or a detached signature) or when someone else could change it
    in place (:func:`_others_may_write`). Before a byte is copied, a file that is not the user's
    alone must not be sparse (a few blocks claiming gigabytes), and every file must fit the
    temporary folder.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a planted FIFO must not block
    except OSError as exc:
        raise ArtifactError(f"no artifact at {path} ({exc.strerror})") from exc
    file = os.fdopen(fd, "rb")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        file.close()
        raise ArtifactError(f"no artifact at {path}: it is not a regular file")
    foreign = _others_may_write(info)
    if not (private or foreign):
        return file, None
    with file:
        _check_before_copy(path, info, foreign)
        copy = tempfile.TemporaryFile(prefix="aitune-artifact-")  # noqa: SIM115 (the reader closes it)
        digest = hashlib.sha256()
        for block in iter(lambda: file.read(_CHUNK), b""):
            digest.update(block)
            copy.write(block)
    copy.flush()
    copy.seek(0)
    return copy, digest.hexdigest()


def _check_before_copy(path: Path, info: os.stat_result, foreign: bool) -> None:
    """Refuse, before copying, a file that would cost more than it holds or more than the disk has."""
    blocks = getattr(info, "st_blocks", None)
    if foreign and blocks is not None and blocks * 512 < info.st_size // 2:
        raise ArtifactError(
            f"{path} claims {info.st_size} bytes but holds {blocks * 512} on disk (a sparse file), and it is not yours "
            "alone; aitune writes no sparse artifacts: copy it to a file of your own (cp --sparse=never) if you trust it"
        )
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if info.st_size > free:
        raise ArtifactError(
            f"{path} ({info.st_size} bytes) is read from a private copy, and the temporary folder "
            f"{tempfile.gettempdir()} has {free} bytes free; point TMPDIR at a folder with room"
        )


def _others_may_write(info: os.stat_result) -> bool:
    """Someone else could change the file in place: another user owns it, group or others may write
    it, or it has another name (a hard link), perhaps in a folder others write."""
    if not hasattr(os, "getuid"):  # no POSIX owners: the file's ACL decides
        return False
    return (
        info.st_uid not in (os.getuid(), 0) or bool(info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)) or info.st_nlink > 1
    )


@contextmanager
def open_artifact(path: Path, expected_sha256: str | None = None, *, private: bool = False) -> Iterator[Reader]:
    reader = Reader(path, expected_sha256, private=private)
    try:
        yield reader
    finally:
        reader.close()
