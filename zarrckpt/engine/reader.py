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
then the chunks where it says (:func:`read_any`), so that read cannot be planned ahead.

A constant array (no shard objects by design) is read without a request: every element is its
fill value. With ``any_layout`` its shards are looked for too (a peer may have written some).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace

import crc32c
import numpy as np

from zarrckpt.engine import shardcheck
from zarrckpt.engine.anylayout import read_any
from zarrckpt.engine.chunkcopy import check_entry, chunk_where, copy_chunk, fill_task, fill_value
from zarrckpt.errors import CorruptChunkError, ModifiedCheckpointError, StorageError
from zarrckpt.format import dtypes, integrity
from zarrckpt.format.deferred import Deferred
from zarrckpt.format.gcpause import gc_paused
from zarrckpt.format.shard import ShardLayout
from zarrckpt.plan.fetch import (
    Fetch,
    Request,
    ShardRead,
    ShardTask,
    lazy_caps,
    plan_reads,
    plan_shard,
)
from zarrckpt.storage.retry import BadRead, past_end
from zarrckpt.storage.store import Storage

__all__ = ["PartRead", "Request", "read_regions", "read_shard"]

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
    planned: Sequence[ShardRead] | None = None,
) -> int:
    """Fill every request's ``dest``; returns the number of bytes fetched from storage.

    ``partial``: fetch only the needed byte ranges of inner chunks that are needed in small part,
    at the price of not checking those chunks' crc32c (see :mod:`zarrckpt.plan.fetch`); each such
    chunk is appended to ``partly`` (when given).
    ``any_layout``: read shards laid out by any Zarr writer (``allow_modified``), see :func:`read_any`.
    ``read_through=False``: never fetch the chunks between two needed ones (a fanned-out read: other
    ranks read those). ``lazy``: a lazy view's read, which reads through smaller gaps (:func:`lazy_caps`).
    ``planned``: the reads, planned already as this function would plan them (a local tier's restore
    planned them to know which byte ranges to receive).
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
    reads = planned if planned is not None else (plan_shard(task, caps, partial) for task in plan_reads(stored))
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
    """Run shard reads concurrently: planned ones, or tasks for :func:`read_any`; the bytes fetched."""

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
    """Run one shard's planned ``read``, or (None) read it whatever its layout (:func:`read_any`);
    returns the bytes fetched.

    Raises:
        CorruptChunkError: the object is missing or truncated, or an index entry or chunk fails its check.
    """
    try:
        return read_any(storage, task) if read is None else run(storage, read)
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
            fetched += shardcheck.again(storage, read.task.path, again, None if read.reads_index else read, bad)
    _scatter_pieces(read.task, scratch)
    return fetched


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
                index = shardcheck.decoded(raw, layout.n_chunks, storage.where(path), task.meta.key, blob)
                for k in task.needs:
                    check_entry(index[k], layout, task.meta, path, k)
            if short:
                if not read.reads_index:
                    shardcheck.explain(storage, read, [*fetch.chunks, *fetch.anchors, *(k for k, _, _ in fetch.pieces)])
                raise shardcheck.truncated(storage, task, layout, fetch.start, fetch.end, fetch.start + len(blob))
            for k in fetch.chunks:
                at = _offset(layout, k) - fetch.start
                try:
                    copy_chunk(task, k, blob[at : at + layout.chunk_nbytes], path, blob)
                except ModifiedCheckpointError:  # its own crc32c holds: no damage on the way
                    if not read.reads_index:
                        shardcheck.explain(storage, read, [k])
                    raise
            for k in fetch.anchors:  # a partly read chunk, without the index: is it the one committed?
                at = _offset(layout, k) + layout.chunk_nbytes - 4 - fetch.start
                try:
                    integrity.check_chunk(task.meta, task.index, k, blob[at : at + 4], chunk_where(task, k, path))
                except ModifiedCheckpointError:
                    shardcheck.explain(storage, read, [k])
                    raise
            for k, lo, hi in fetch.pieces:
                first, buf = scratch[k]
                at = _offset(layout, k) + lo - fetch.start
                buf[lo - first : hi - first] = np.frombuffer(blob[at : at + hi - lo], dtype=np.uint8)
            return len(blob)
    except StorageError as e:  # a range the object does not reach: S3's 416 InvalidRange
        if not past_end(e):
            raise
        raise shardcheck.truncated(storage, task, layout, fetch.start, fetch.end) from None


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
            raise shardcheck.truncated(storage, task, layout, 0, fetch.end, got)
        index = shardcheck.decoded(bytes(head), layout.n_chunks, storage.where(path), task.meta.key)
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
