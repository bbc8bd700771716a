"""Run read plans (:mod:`zarrckpt.plan.fetch`): fetch byte ranges of shard objects, verify, copy into place.

When a plan fetches the shard index (always first), its crc32c and every entry the plan uses
are checked against zarrckpt's layout before any chunk is used. Every chunk read whole has its
crc32c checked, and, when the manifest has a commit record, compared with the committed one
(:mod:`zarrckpt.format.integrity`); a chunk read without the index that fails is explained by fetching
the index then. A read whose bytes fail a checksum (an index, a chunk's own crc32c) is read again
first (:func:`~zarrckpt.storage.retry.read_again`: bytes damaged on the way differ from one read to
the next; the same bytes twice are what is stored). Pieces of partly read chunks (lazy views)
cannot be checked: ``partly`` collects those chunks.

``any_layout`` (``allow_modified``) reads shards another Zarr writer laid out: the index first,
then the chunks where it says (:func:`_read_any`), so that read cannot be planned ahead.

A constant array (no shard objects by design) is read without a request: every element is its
fill value. With ``any_layout`` its shards are looked for too (a peer may have written some).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import TypeVar

import crc32c
import numpy as np

from zarrckpt.engine.chunkcopy import check_entry, chunk_where, copy_chunk, fill_task, fill_value
from zarrckpt.errors import CorruptChunkError, ModifiedCheckpointError, StorageError
from zarrckpt.format import dtypes, integrity
from zarrckpt.format.deferred import Deferred
from zarrckpt.format.gcpause import gc_paused
from zarrckpt.format.shard import EMPTY, ShardLayout, chunks_per_shard, decode_index, index_nbytes
from zarrckpt.plan.fetch import (
    MAX_REQUEST_BYTES,
    Fetch,
    Request,
    ShardRead,
    ShardTask,
    lazy_caps,
    plan_reads,
    plan_shard,
)
from zarrckpt.plan.ranges import Range, merge_ranges
from zarrckpt.storage.retry import BadRead, past_end, read_again
from zarrckpt.storage.store import Storage

__all__ = ["PartRead", "Request", "read_regions", "read_shard"]

T = TypeVar("T")
PartRead = tuple[str, int, int]  # a chunk read in part, unchecked: (where, bytes of it used, its stored bytes)
Scratch = dict[int, tuple[int, np.ndarray]]  # partly read chunk -> (its first byte read, the bytes read)


@gc_paused()  # planning a shard per tensor allocates many small objects, none in a cycle
def read_regions(
    storage: Storage,
    requests: Sequence[Request],
    *,
    partial: bool = False,
    any_layout: bool = False,
    read_through: bool = True,
    lazy: bool = False,
    partly: list[PartRead] | None = None,
) -> int:
    """Fill every request's ``dest``; returns the number of bytes fetched from storage.

    ``partial``: fetch only the needed byte ranges of inner chunks that are needed in small part,
    at the price of not checking those chunks' crc32c (see :mod:`zarrckpt.plan.fetch`); each such
    chunk is appended to ``partly`` (when given).
    ``any_layout``: read shards laid out by any Zarr writer (``allow_modified``), see :func:`_read_any`.
    ``read_through=False``: never fetch the chunks between two needed ones (a fanned-out read: other
    ranks read those). ``lazy``: a lazy view's read, which reads through smaller gaps (:func:`lazy_caps`).
    """
    if any_layout:  # constant arrays too: a peer may have written chunks into them since
        return _run_all(storage, plan_reads(requests))
    for req in requests:
        if req.meta.constant is not None:  # no chunks by design: every element is the fill value
            req.dest[...] = fill_value(req.meta)
    stored = [req for req in requests if req.meta.constant is None]
    caps = storage.caps if read_through else replace(storage.caps, read_through_bytes=0)
    caps = lazy_caps(caps) if lazy else caps
    # planned shard by shard as the reads go: a read that fails stops the planning too
    reads = (plan_shard(task, caps, partial) for task in plan_reads(stored))
    return _run_all(storage, _checksums_beside(stored, (one for read in reads for one in _apart(read, lazy))), partly)


def _checksums_beside(requests: Sequence[Request], reads: Iterator[ShardRead]) -> Iterator[ShardRead]:
    """``reads``, the committed chunk checksums still on their way (a lazy view's first read of a
    tensor, :class:`~zarrckpt.format.Deferred`) requested as the first read goes out: the
    segment's GET and the first data GET in flight together, one round trip."""
    first = True
    for read in reads:
        if first:
            for req in requests:
                if isinstance(req.meta.committed_crc32c, Deferred):
                    req.meta.committed_crc32c.start()
            first = False
        yield read


def _apart(read: ShardRead, lazy: bool) -> list[ShardRead]:
    """A lazy read's GETs of one shard, each a read of its own so that they run concurrently (a
    column of tiles: a GET per band), where none holds the index and no chunk's pieces span two of
    them; otherwise ``read`` as it is (its fetches run in order)."""
    if not lazy or len(read.fetches) < 2 or read.reads_index:
        return [read]
    pieces = [k for fetch in read.fetches for k in {k for k, _, _ in fetch.pieces}]
    if len(pieces) != len(set(pieces)):
        return [read]
    return [ShardRead(read.task, read.layout, (fetch,)) for fetch in read.fetches]


def _run_all(storage: Storage, work: Iterable[ShardRead | ShardTask], partly: list[PartRead] | None = None) -> int:
    """Run shard reads concurrently: planned ones, or tasks for :func:`_read_any`; the bytes fetched."""

    def one(item: ShardRead | ShardTask) -> int:
        if not isinstance(item, ShardRead):
            return read_shard(storage, item, None)
        if partly is not None:
            partly.extend(_partly_read(storage, item))
        return read_shard(storage, item.task, item)

    small = storage.caps.inline_read_bytes

    def inline(item: ShardRead | ShardTask) -> bool:
        return isinstance(item, ShardRead) and item.nbytes <= small

    return sum(storage.run_all(one, work, inline=inline if small else None))


def read_shard(storage: Storage, task: ShardTask, read: ShardRead | None) -> int:
    """Run one shard's planned ``read``, or (None) read it whatever its layout (:func:`_read_any`);
    returns the bytes fetched.

    Raises:
        CorruptChunkError: the object is missing or truncated, or an index entry or chunk fails its check.
    """
    try:
        return _read_any(storage, task) if read is None else run(storage, read)
    except FileNotFoundError:
        if task.meta.constant is not None:  # a constant array's shard no one wrote (allow_modified)
            fill_task(task)
            return 0
        where, key = storage.where(task.path), task.meta.key
        raise CorruptChunkError(f"shard object {where} of {key!r} is missing", key=key, chunk=task.path) from None


def run(storage: Storage, read: ShardRead) -> int:
    """Run one shard's fetches in order; returns the bytes fetched."""
    # per partly read chunk: the bytes from its first to its last piece (gaps left unfilled)
    spans: dict[int, tuple[int, int]] = {}
    for fetch in read.fetches:
        for k, lo, hi in fetch.pieces:
            first, last = spans.get(k, (lo, hi))
            spans[k] = (min(first, lo), max(last, hi))
    scratch = {k: (lo, np.empty(hi - lo, dtype=np.uint8)) for k, (lo, hi) in spans.items()}
    fetched = 0
    for fetch in read.fetches:
        try:
            fetched += _read_direct(storage, read, fetch) if fetch.direct else _fetch(storage, read, fetch, scratch)
        except BadRead as bad:  # read again (only once a check failed: no cost on the way that succeeds)
            again = functools.partial(_read_direct, storage, read, fetch)
            if not fetch.direct:
                again = functools.partial(_fetch, storage, read, fetch, scratch)
            # a read without the index whose chunk fails as stored: the index tells another writer's layout
            fetched += _again(storage, read.task.path, again, None if read.reads_index else read, bad)
    _scatter_pieces(read.task, scratch)
    return fetched


def _again(
    storage: Storage,
    path: str,
    attempt: Callable[[], T],
    explain: ShardRead | None = None,
    failed: BadRead | None = None,
) -> T:
    """``attempt()`` (``failed``: how it failed once already), read again while its bytes fail a
    checksum (:class:`BadRead`) and differ from every earlier attempt's (:func:`read_again`); then
    its error, after :func:`_explain` of ``explain``'s chunks it concerns (which may raise an error
    that explains it better)."""
    try:
        return read_again(attempt, storage.retry, storage.where(path), lambda: storage.traffic.add(retries=1), failed)
    except BadRead as bad:
        if explain is not None and bad.chunks:
            _explain(storage, explain, bad.chunks)
        raise bad.error from None


def _fetch(storage: Storage, read: ShardRead, fetch: Fetch, scratch: Scratch) -> int:
    """One ranged read of ``read``: check what it holds, copy it into place; the bytes fetched (a
    BadRead when the index or a chunk fails its own crc32c)."""
    task, layout = read.task, read.layout
    path = task.path
    try:
        with storage.reading(path, fetch.start, fetch.end) as blob:
            short = fetch.end is not None and len(blob) < fetch.end - fetch.start
            if fetch.index and (len(blob) >= layout.index_nbytes or not short):  # another layout: say so first
                raw = bytes(blob[: layout.index_nbytes])
                index = _decoded(raw, layout.n_chunks, storage.where(path), task.meta.key, blob)
                for k in task.needs:
                    check_entry(index[k], layout, task.meta, path, k)
            if short:
                if not read.reads_index:
                    _explain(storage, read, [*fetch.chunks, *fetch.anchors, *(k for k, _, _ in fetch.pieces)])
                raise _truncated(storage, task, layout, fetch.start, fetch.end, fetch.start + len(blob))
            for k in fetch.chunks:
                at = _offset(layout, k) - fetch.start
                try:
                    copy_chunk(task, k, blob[at : at + layout.chunk_nbytes], path, blob)
                except ModifiedCheckpointError:  # its own crc32c holds: no damage on the way
                    if not read.reads_index:
                        _explain(storage, read, [k])
                    raise
            for k in fetch.anchors:  # a partly read chunk, without the index: is it the one committed?
                at = _offset(layout, k) + layout.chunk_nbytes - 4 - fetch.start
                try:
                    integrity.check_chunk(task.meta, task.index, k, blob[at : at + 4], chunk_where(task, k, path))
                except ModifiedCheckpointError:
                    _explain(storage, read, [k])
                    raise
            for k, lo, hi in fetch.pieces:
                first, buf = scratch[k]
                at = _offset(layout, k) + lo - fetch.start
                buf[lo - first : hi - first] = np.frombuffer(blob[at : at + hi - lo], dtype=np.uint8)
            return len(blob)
    except StorageError as e:  # a range the object does not reach: S3's 416 InvalidRange
        if not past_end(e):
            raise
        raise _truncated(storage, task, layout, fetch.start, fetch.end) from None


def _decoded(raw: bytes, n_chunks: int, where: str, key: str, blob: memoryview | None = None) -> np.ndarray:
    """The shard index in ``raw`` (the first bytes of ``blob``, which the digest covers when given);
    BadRead when it fails its crc32c."""
    try:
        return decode_index(raw, n_chunks, where, key)
    except CorruptChunkError as e:
        raise BadRead(e, crc32c.crc32c(raw if blob is None else blob)) from None


def _index(storage: Storage, path: str, n_chunks: int, key: str) -> np.ndarray:
    """The verified index of shard object ``path`` (one ranged read; again when it fails its crc32c)."""

    def fetch() -> np.ndarray:
        with storage.reading(path, 0, index_nbytes(n_chunks)) as raw:
            return _decoded(bytes(raw), n_chunks, storage.where(path), key)

    return _again(storage, path, fetch)


def _partly_read(storage: Storage, read: ShardRead) -> list[PartRead]:
    """The chunks ``read`` reads in part, unchecked: (where, bytes of it used, its stored bytes)."""
    got: dict[int, int] = {}
    for fetch in read.fetches:
        for k, lo, hi in fetch.pieces:
            got[k] = got.get(k, 0) + hi - lo
    if not got:
        return []
    where = storage.where(read.task.path)
    return [(chunk_where(read.task, k, where), n, read.layout.chunk_nbytes) for k, n in sorted(got.items())]


def _truncated(
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


def _explain(storage: Storage, read: ShardRead, chunks: Sequence[int]) -> None:
    """A read without its shard's index failed (a chunk's checksum, or the object is too short):
    raise ModifiedCheckpointError if the index (now fetched) shows another writer's layout for
    one of ``chunks``; else return, and the read's own error stands."""
    task, layout = read.task, read.layout
    index = _index(storage, task.path, layout.n_chunks, task.meta.key)
    for k in sorted(set(chunks)):
        check_entry(index[k], layout, task.meta, task.path, k)


def _offset(layout: ShardLayout, k: int) -> int:
    offset = layout.offset(k)
    assert offset is not None  # plans only hold stored chunks
    return offset


def _scatter_pieces(task: ShardTask, scratch: Scratch) -> None:
    """Copy the parts of partly read chunks into place, as strided views of the fetched bytes."""
    meta = task.meta
    dtype = dtypes.storage_dtype(meta.dtype)
    strides = tuple(math.prod(meta.chunk_shape[d + 1 :]) * dtype.itemsize for d in range(len(meta.chunk_shape)))
    for k, (first, buf) in scratch.items():
        _, origin = task.chunk_origin(k)
        for part, req in task.needs[k]:
            rel = part.relative_to(origin)
            offset = sum(o * st for o, st in zip(rel.offsets, strides, strict=True)) - first
            # numpy checks that the view lies inside the fetched bytes
            src = np.ndarray(rel.sizes, dtype=dtype, buffer=buf, offset=offset, strides=strides)
            req.dest[part.relative_to(req.box.offsets).slices()] = src


def _read_any(storage: Storage, task: ShardTask) -> int:
    """Read one shard whatever its layout: chunks in any order, gaps between them, EMPTY entries
    (read as the fill value). Still checked: the index crc32c, each chunk's size (uncompressed),
    that it lies after the index and inside the object, and its crc32c."""
    meta = task.meta
    path = meta.shard_path(task.index)
    n_chunks = math.prod(chunks_per_shard(meta.shard_shape, meta.chunk_shape))
    head = index_nbytes(n_chunks)
    size = meta.chunk_nbytes + 4
    index = _index(storage, path, n_chunks, meta.key)
    ranges: list[Range] = []
    chunks: list[int] = []
    for k in sorted(task.needs):
        offset, nbytes = int(index[k][0]), int(index[k][1])
        if offset == EMPTY and nbytes == EMPTY:  # never written: the fill value
            for part, req in task.needs[k]:  # (no chunk-sized buffer: its size is the metadata's word)
                req.dest[part.relative_to(req.box.offsets).slices()] = fill_value(meta)
        elif nbytes != size or offset < head:
            raise CorruptChunkError(
                f"inner chunk {k} of {meta.key!r} in shard {path} has index entry ({offset}, {nbytes}); "
                f"zarrckpt reads uncompressed chunks of {size} bytes stored after the {head}-byte index",
                key=meta.key,
                chunk=f"{path}#{k}",
            )
        else:
            ranges.append((offset, offset + size))
            chunks.append(k)
    fetched = head
    for start, end, members in merge_ranges(ranges, 0, MAX_REQUEST_BYTES):
        parts = [(ranges[i][0] - start, chunks[i]) for i in members]
        fetched += _again(storage, path, functools.partial(_read_range, storage, task, start, end, parts))
    return fetched


def _read_range(storage: Storage, task: ShardTask, start: int, end: int, parts: list[tuple[int, int]]) -> int:
    """Read bytes ``[start, end)`` of a shard laid out by any writer, which hold whole chunks (each
    ``(place in the range, chunk)`` of ``parts``): check and copy them; the bytes fetched."""
    meta, path = task.meta, task.path
    with storage.reading(path, start, end) as blob:
        if len(blob) < end - start:
            raise CorruptChunkError(
                f"shard object {storage.where(path)} of {meta.key!r} is shorter than its index says: bytes "
                f"{start}..{end} hold {len(blob)} of {end - start} bytes (truncated)",
                key=meta.key,
                chunk=path,
            )
        for at, k in parts:
            copy_chunk(task, k, blob[at : at + meta.chunk_nbytes + 4], path, blob)
        return len(blob)


def _read_direct(storage: Storage, read: ShardRead, fetch: Fetch) -> int:
    """Read a run of whole chunks straight into their destinations (one vectored read, the shard's
    index first when the run follows it), then verify (a chunk or index failing its crc32c: BadRead)."""
    task, layout = read.task, read.layout
    path = task.path
    views: list[memoryview] = []
    for k in fetch.chunks:
        view = task.direct_view(k)
        assert view is not None  # a fetch is direct only when every chunk in it has a view
        views.append(view)
    crcs = [bytearray(4) for _ in fetch.chunks]
    head = bytearray(layout.index_nbytes if fetch.index else 0)
    buffers = [memoryview(head)] if head else []
    buffers += [b for view, crc in zip(views, crcs, strict=True) for b in (view, memoryview(crc))]
    got = storage.read_into(path, fetch.start, buffers)
    if head:
        if got < len(head):
            raise _truncated(storage, task, layout, 0, fetch.end, got)
        index = _decoded(bytes(head), layout.n_chunks, storage.where(path), task.meta.key)
        for k in task.needs:
            check_entry(index[k], layout, task.meta, path, k)
        got -= len(head)
    for k, view, crc in zip(fetch.chunks, views, crcs, strict=True):
        where = f"{path} (inner chunk {k})"
        if got < len(view) + 4:
            raise CorruptChunkError(f"chunk {where} of {task.meta.key!r} is truncated", key=task.meta.key, chunk=where)
        got -= len(view) + 4
        if crc32c.crc32c(view) != int.from_bytes(crc, "little"):
            error = CorruptChunkError(
                f"chunk {where} of {task.meta.key!r} fails its crc32c checksum: the stored bytes are corrupted",
                key=task.meta.key,
                chunk=where,
            )
            raise BadRead(error, crc32c.crc32c(b"".join(map(bytes, buffers))), (k,))
        integrity.check_chunk(task.meta, task.index, k, crc, where)
    return len(head) + sum(len(v) + 4 for v in views)
