"""Reading the chunk checksum table (docs/FORMAT.md §6, format version 3): whole, once per load,
verify or copy; or one array's segment, beside a lazy read's first data read.

The manifest records the table's size and crc32c and each array's segment (offset, bytes, crc32c):
a table damaged on the way is read again before it is believed, as a manifest is; a table changed
or gone after commit leaves the arrays it no longer backs ``modified`` (loads refuse them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from zarrckpt.format import integrity
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.deferred import Deferred
from zarrckpt.format.manifest import Manifest
from zarrckpt.storage.store import Storage

log = logging.getLogger("zarrckpt")


def read_table(storage: Storage) -> bytes:
    """The table's bytes as stored; ``b""`` when it is missing."""
    try:
        return storage.read(integrity.TABLE, 0)
    except FileNotFoundError:
        return b""


def with_table(manifest: Manifest, read: Callable[[], bytes], attempts: int, where: str) -> Manifest:
    """``manifest`` with its arrays' committed chunk checksums from the table ``read`` returns (no
    read when it has no table, or an empty one). A table whose crc32c does not match is read again,
    up to ``attempts`` reads, until two reads agree: damage on the way differs from one read to the
    next."""
    ref = manifest.table_ref
    if ref is None or manifest.unrecorded:
        return manifest
    if ref["bytes"] == 0:  # (only constant arrays)
        return manifest.with_table(b"")
    raw = read()
    for _ in range(1, attempts):
        if integrity.table_matches(raw, ref):
            break
        log.info("read %s again: it does not match the crc32c its manifest recorded (damaged on the way?)", where)
        again = read()
        if again == raw:
            break
        raw = again
    return manifest.with_table(raw)


def segment_reader(storage: Storage, meta: ArrayMeta) -> Deferred:
    """``meta``'s committed chunk checksums, fetched when a read starts (:class:`Deferred`)."""
    return Deferred(lambda: read_segment(storage, meta))


def read_segment(storage: Storage, meta: ArrayMeta) -> bytes:
    """``meta``'s segment of the table (one ranged GET), checked against its crc32c in the manifest
    (read once more before a mismatch is believed). Raises ModifiedCheckpointError when it is not the
    committed one, or the table is gone."""
    assert meta.crc_segment is not None
    offset, nbytes, _ = meta.crc_segment
    found = b""
    for attempt in range(2):
        try:
            found = storage.read(integrity.TABLE, offset, offset + nbytes) if nbytes else b""
        except FileNotFoundError:
            found = b""
        try:
            return integrity.check_segment(meta, found)
        except Exception:
            if attempt:
                raise
            storage.traffic.add(retries=1)
    raise AssertionError("unreachable")
