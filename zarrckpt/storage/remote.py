"""The filesystem backend: any fsspec filesystem (s3fs, gcsfs, memory://, ...) or obstore's
(:mod:`zarrckpt.storage.obstorefs`): one request per call, whole objects per write.

Every write is checked end to end where the store can tell what it stored: on S3 the body goes
with its ``Content-MD5`` (s3fs; AWS and Ceph RGW refuse a body that does not match it, measured on
RGW 16.2: ``BadDigest``) and the ETag the PUT returns (an MD5 of what the server stored, for a
single PUT without KMS encryption) is compared with the body's MD5 (s3fs and obstore; moto
checks no header, but its ETags tell); on GCS the object's crc32c in the upload's answer is
compared with the body's. A difference raises :class:`UploadCorrupted`, which the storage layer
retries by writing again. A write no such check covers returns False: the caller reads it back.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import crc32c

from zarrckpt.errors import ZarrckptError
from zarrckpt.storage.caps import OBJECT_STORE, NameLimits, ReadCaps
from zarrckpt.storage.retry import missing_bucket

log = logging.getLogger("zarrckpt")
Buffer = bytes | memoryview
# Clients whose ``pipe_file(..., mode="create")`` is an atomic create-only write on the server:
# S3 ``If-None-Match: *`` (obstore, s3fs), GCS ``ifGenerationMatch=0`` (gcsfs). fsspec's memory store
# checks when a file is opened and stores it when closed: not atomic between threads.
ATOMIC_CREATE_CLIENTS = ("obstore", "s3fs", "gcsfs")
_warned_no_create: set[str] = set()
_MD5_CLIENTS = ("s3fs", "obstore")  # ETags of single PUTs are MD5s (unless the bucket encrypts with KMS)


class UploadCorrupted(OSError):
    """The store holds other bytes than were sent: damaged on the way. Transient (errno EIO): the
    write is retried, which rewrites the object."""

    def __init__(self, full: str, how: str) -> None:
        super().__init__(errno.EIO, f"the object stored differs from the bytes sent ({how}): damaged on the way", full)


class CreatedCorrupt(ZarrckptError):
    """A create-only write made the object, but it holds other bytes than were sent: the object is
    this writer's, so it is overwritten (not a race lost to another writer). Never retried as such
    (a ZarrckptError): the storage layer overwrites instead."""


class RemoteBackend:
    """The filesystem ``fs`` of client ``client`` (``"s3fs"``, ``"obstore"``, ``"memory"``, ...)."""

    caps: ReadCaps = OBJECT_STORE
    vectored = False

    def __init__(self, fs: Any, client: str) -> None:
        self.fs = fs
        self.client = client
        self.atomic_create = client in ATOMIC_CREATE_CLIENTS
        self._etags_are_md5 = client in _MD5_CLIENTS  # until one is not (KMS encryption)

    def name_limits(self, root: str) -> NameLimits:
        """S3 and GCS: an object name (the key, after the bucket) of at most 1,024 bytes."""
        if self.client in ("s3fs", "obstore", "gcsfs"):
            key = root.split("/", 1)[1] if "/" in root else ""
            return NameLimits("GCS" if self.client == "gcsfs" else "S3", len(key.encode()), None, 1024)
        return NameLimits(self.client, len(root.encode()))

    def write(self, full: str, parts: Sequence[Buffer]) -> bool:
        """One PUT of the whole object; whether it was checked end to end (False: read it back).

        Raises:
            UploadCorrupted: the store holds other bytes than were sent (retry: it rewrites them).
        """
        data = b"".join(parts)
        md5 = self._md5(data)
        return self._checked(full, data, md5, self.fs.pipe_file(full, data, **self._headers(md5)))

    def create(self, full: str, parts: Sequence[Buffer], durable: bool = True) -> bool | None:
        """Write a new object: None (nothing written) when the store says it exists; else whether it
        was checked end to end.

        Atomic on clients with create-only writes; elsewhere a check followed by a write (logged once).
        (``durable`` is the local backend's: a stored object is durable once its request returns.)

        Raises:
            CreatedCorrupt: the object was made, but holds other bytes than were sent.
        """
        data = b"".join(parts)
        md5 = self._md5(data)
        if self.atomic_create:
            try:
                out = self.fs.pipe_file(full, data, mode="create", **self._headers(md5))
            except FileExistsError:
                return None
            except OSError as e:  # s3fs turns some servers' 412 (Ceph RGW) into OSError(EINVAL)
                if e.errno != errno.EINVAL:
                    raise
                if self.fs.exists(full):
                    return None
                # Measured on Ceph RGW: a create racing another can be refused before the other's
                # object is visible; try again (transient: retried with backoff) until one of them is.
                raise OSError(errno.EAGAIN, f"create refused ({e}), yet no object is there: a racing create?") from e
            try:
                return self._checked(full, data, md5, out)
            except UploadCorrupted as e:
                raise CreatedCorrupt(str(e)) from e
        name = type(self.fs).__name__
        if name not in _warned_no_create:
            _warned_no_create.add(name)
            log.warning(
                "%s has no create-only writes: two saves racing to one location are told apart by a check "
                "followed by a write, which is not atomic",
                name,
            )
        if self.fs.exists(full):
            return None
        try:
            return self._checked(full, data, md5, self.fs.pipe_file(full, data))
        except UploadCorrupted as e:
            raise CreatedCorrupt(str(e)) from e

    def _md5(self, data: bytes) -> bytes | None:
        """The body's MD5 where something checks it (hashlib releases the GIL: writer threads overlap)."""
        return hashlib.md5(data, usedforsecurity=False).digest() if self.client in _MD5_CLIENTS else None

    def _headers(self, md5: bytes | None) -> dict[str, Any]:
        """What a PUT carries for the server to check (s3fs passes ``ContentMD5`` on to S3)."""
        return {"ContentMD5": base64.b64encode(md5).decode()} if md5 is not None and self.client == "s3fs" else {}

    def _checked(self, full: str, data: bytes, md5: bytes | None, answer: Any) -> bool:
        """Whether the PUT's answer shows the store holds ``data``; raises UploadCorrupted when it shows
        it does not; False when it shows nothing (a multipart ETag, no answer, another client)."""
        if self.client == "gcsfs":  # the object resource of a simple upload: GCS's own crc32c of it
            stored = answer.get("crc32c") if isinstance(answer, dict) else None
            if not isinstance(stored, str):
                return False
            if base64.b64decode(stored) != crc32c.crc32c(data).to_bytes(4, "big"):
                raise UploadCorrupted(full, f"GCS crc32c {stored}")
            return True
        if md5 is None or not self._etags_are_md5 or not isinstance(answer, dict):
            return False
        etag = str(answer.get("ETag") or answer.get("e_tag") or "").strip('"')
        if not etag or "-" in etag:  # none, or a multipart upload's (an MD5 of MD5s)
            return False
        if etag == md5.hex():
            return True
        if self.stored(full) != data:  # tell a damaged body from an ETag that is no MD5
            raise UploadCorrupted(full, f"ETag {etag}, the body's MD5 {md5.hex()}")
        log.info("%s answers ETags that are not MD5s (KMS encryption?): each object written is read back", full)
        self._etags_are_md5 = False
        return True

    def get(self, full: str, start: int | None, end: int | None) -> Any:
        """What the filesystem read: bytes, or a buffer of its own (obstore's ``Bytes``)."""
        return self.fs.cat_file(full, start=start, end=end)

    def stored(self, full: str) -> bytes | None:
        """The object as stored, read back whole; None when the store's own checksum of it (recorded
        from the PUT's checksum header, which botocore sends) disagrees with its bytes."""
        try:
            return bytes(self.fs.cat_file(full))
        except Exception as e:
            if type(e).__name__ == "FlexibleChecksumError":  # botocore: the body fails the stored checksum
                return None
            raise

    def read_view(self, full: str, start: int | None, end: int | None) -> tuple[bytearray | None, memoryview]:
        return None, memoryview(self.get(full, start, end))  # obstore's buffer as it came: no copy

    def release(self, buf: bytearray | None) -> None:
        pass  # nothing pooled

    def read_into(self, full: str, offset: int, buffers: Sequence[memoryview]) -> int:
        raise NotImplementedError("vectored reads are for local files")

    def is_empty(self, root: str) -> bool:
        """One listing of the root's direct entries, however many objects lie below them."""
        try:
            return not self.fs.ls(root, detail=False, refresh=True)
        except FileNotFoundError as e:
            if missing_bucket(e):  # (said as such by the caller)
                raise
            return True

    def prune(self, root: str) -> None:
        pass  # object stores have no directories to leave behind

    def forget(self) -> None:
        self.fs.invalidate_cache()
