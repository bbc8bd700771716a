"""A shard read's checks and their diagnosis: read again while bytes fail a checksum, fetch and
check a shard's index, and say what a failed read means (a truncated object, another writer's
layout). Used by :mod:`zarrckpt.engine.reader` and :mod:`zarrckpt.engine.anylayout`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import crc32c
import numpy as np

from zarrckpt.engine.chunkcopy import check_entry
from zarrckpt.errors import CorruptChunkError, StorageError
from zarrckpt.format.shard import ShardLayout, decode_index, index_nbytes
from zarrckpt.plan.fetch import ShardRead, ShardTask
from zarrckpt.storage.retry import BadRead, read_again
from zarrckpt.storage.store import Storage

T = TypeVar("T")


def again(
    storage: Storage,
    path: str,
    attempt: Callable[[], T],
    unindexed: ShardRead | None = None,
    failed: BadRead | None = None,
) -> T:
    """``attempt()`` (``failed``: how it failed once already), read again while its bytes fail a
    checksum (:class:`BadRead`) and differ from every earlier attempt's (:func:`read_again`); then
    its error, after :func:`explain` of ``unindexed``'s chunks it concerns (which may raise an error
    that explains it better)."""
    try:
        return read_again(attempt, storage.retry, storage.where(path), lambda: storage.traffic.add(retries=1), failed)
    except BadRead as bad:
        if unindexed is not None and bad.chunks:
            explain(storage, unindexed, bad.chunks)
        raise bad.error from None


def explain(storage: Storage, read: ShardRead, chunks: Sequence[int]) -> None:
    """A read without its shard's index failed (a chunk's checksum, or the object is too short):
    raise ModifiedCheckpointError if the index (now fetched) shows another writer's layout for
    one of ``chunks``; else return, and the read's own error stands."""
    task, layout = read.task, read.layout
    index = index_of(storage, task.path, layout.n_chunks, task.meta.key)
    for k in sorted(set(chunks)):
        check_entry(index[k], layout, task.meta, task.path, k)


def index_of(storage: Storage, path: str, n_chunks: int, key: str) -> np.ndarray:
    """The verified index of shard object ``path`` (one ranged read; again when it fails its crc32c)."""

    def fetch() -> np.ndarray:
        with storage.reading(path, 0, index_nbytes(n_chunks)) as raw:
            return decoded(bytes(raw), n_chunks, storage.where(path), key)

    return again(storage, path, fetch)


def decoded(raw: bytes, n_chunks: int, where: str, key: str, blob: memoryview | None = None) -> np.ndarray:
    """The shard index in ``raw`` (the first bytes of ``blob``, which the digest covers when given);
    BadRead when it fails its crc32c."""
    try:
        return decode_index(raw, n_chunks, where, key)
    except CorruptChunkError as e:
        raise BadRead(e, crc32c.crc32c(raw if blob is None else blob)) from None


def truncated(
    storage: Storage, task: ShardTask, layout: ShardLayout, start: int, end: int | None, size: int | None = None
) -> CorruptChunkError:
    """A shard object shorter than its layout: its real length, and how many inner chunks it lacks."""
    path = task.path
    if size is None:
        try:
            size = storage.size(path)
        except (StorageError, FileNotFoundError):
            size = None
    lost = None if size is None else layout.n_stored - layout.chunks_from(size)
    lacking = "" if size is None else f": {size} bytes of {layout.nbytes}, {lost} of its {layout.n_stored} inner "
    lacking += "" if size is None else "chunks past its end"
    return CorruptChunkError(
        f"shard object {storage.where(path)} of {task.meta.key!r} is truncated{lacking} (a read of bytes "
        f"{start}..{'' if end is None else end} reaches past it); `zarrckpt verify` lists every chunk lost",
        key=task.meta.key,
        chunk=path,
    )
