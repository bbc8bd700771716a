"""Reads planned as values: which byte ranges of which shard objects, holding what (pure; no I/O).

:func:`plan_fetches` turns read requests into one :class:`ShardRead` per shard touched: its
layout and the :class:`Fetch` es to run, in order (:mod:`zarrckpt.engine.reader` runs them). What the
storage does well (:class:`~zarrckpt.storage.caps.ReadCaps`) shapes the plan:

- object stores pay per request: a shard is fetched whole in one GET when every stored chunk is
  needed, or when it is small (the extra bytes cost less than a request), and it fits one request
  (``ReadCaps.max_request_bytes``);
- otherwise the index, then one ranged read per run of needed chunks (at most
  ``max_request_bytes`` each): chunks stored back to back, and on object stores also chunks at
  most ``ReadCaps.read_through_bytes`` apart (the gap is fetched and dropped: cheaper than a
  request; a lazy view's reads, where bytes count more, only up to RANGE_MERGE_GAP: :func:`lazy_caps`);
  on local files a run whose chunks each go whole into one destination
  is read straight into those destinations (one vectored read). On object stores, when the
  manifest has a commit record (every chunk's crc32c), the byte offsets follow from the manifest
  and the index GET is left out: each chunk is checked against its committed crc32c, and the
  reader fetches the index only to explain a check that fails (a shard another tool rewrote).

With ``partial=True`` (lazy views), an inner chunk of which only a small part is needed is not
read whole: only the byte ranges holding that part are (chunks are uncompressed C-order
elements, see :mod:`zarrckpt.plan.ranges`), ranges at most RANGE_MERGE_GAP apart in one read. Such a
piece cannot be checked against the chunk's crc32c (it covers the whole chunk), so something
else must show that the bytes at the committed offsets are the committed chunk's: either the
shard index (verified, every entry used checked against the layout; folded into the first read
when it is that close), or, on object stores with the commit record, the chunk's own stored
crc32c (its last 4 bytes) compared with the committed one — which also catches a rewrite that
kept the layout. The second is planned only when it saves a request: when each such crc32c lies
within RANGE_MERGE_GAP of the pieces, so no read of its own is needed. A partly needed chunk whose
bytes all fall inside one read anyway (reads through the gaps between pieces) is read whole
instead, and checked like any other.

Every chunk read whole has its crc32c checked (and, with the commit record, compared with the
committed one); every other plan starts with a fetch holding the shard index, which the reader
verifies before it uses any chunk.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from zarrckpt.errors import InvalidCheckpointError, ZarrckptError
from zarrckpt.format import dtypes
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.layout import Box, Shape, cell_box, cells_in, flat_index
from zarrckpt.format.shard import ShardLayout, chunks_per_shard
from zarrckpt.plan.ranges import Range, chunk_ranges, merge_ranges
from zarrckpt.storage.caps import ReadCaps

MAX_REQUEST_BYTES = 8 * 1024 * 1024  # partial and any-layout reads fetch at most this much (bounds read buffers)
SMALL_OBJECT_BYTES = 1024 * 1024  # object stores: a shard this small is read whole, in one GET
RANGE_MERGE_GAP = 256 * 1024  # partial reads: a gap this small is read through (about one request's cost)
MAX_RANGES_PER_CHUNK = 64  # partial reads: more ranges than this in one chunk -> read the chunk whole


@dataclass(frozen=True)
class Request:
    """Copy the global region ``box`` of ``meta`` into ``dest`` (an array of ``box.sizes``)."""

    meta: ArrayMeta
    box: Box
    dest: np.ndarray

    def __post_init__(self) -> None:  # a buffer of another dtype would be filled with reinterpreted bytes
        stored = dtypes.storage_dtype(self.meta.dtype)
        if self.dest.dtype != stored or tuple(self.dest.shape) != tuple(self.box.sizes):
            raise ZarrckptError(
                f"{self.meta.key!r}: a read into a {self.dest.dtype} buffer of shape {list(self.dest.shape)} cannot "
                f"receive {list(self.box.sizes)} elements stored as {self.meta.dtype}: read into the stored dtype, "
                "then convert"
            )


def allocate(meta: ArrayMeta) -> np.ndarray:
    """A host buffer for a whole stored array (bytes values, DCP byte items)."""
    try:
        return np.empty(meta.shape, dtype=dtypes.storage_dtype(meta.dtype))
    except (MemoryError, ValueError) as e:
        raise InvalidCheckpointError(
            f"{meta.key!r} claims {meta.nbytes} bytes, more than can be allocated here ({e}); the checkpoint "
            "metadata is probably corrupted"
        ) from None


@dataclass
class ShardTask:
    """The inner chunks of one shard that requests need."""

    meta: ArrayMeta
    index: Shape
    # inner chunk number -> (part of the region inside that chunk, request it goes to)
    needs: dict[int, list[tuple[Box, Request]]] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return self.meta.shard_path(self.index)

    def chunk_origin(self, k: int) -> tuple[Shape, Shape]:
        """(grid index, global origin) of inner chunk ``k``."""
        meta = self.meta
        grid = chunks_per_shard(meta.shard_shape, meta.chunk_shape)
        cidx = tuple(int(i) for i in np.unravel_index(k, grid)) if grid else ()
        shard_origin = cell_box(self.index, meta.shard_shape, meta.shape).offsets
        return cidx, tuple(o + i * c for o, i, c in zip(shard_origin, cidx, meta.chunk_shape, strict=True))

    def direct_view(self, k: int) -> memoryview | None:
        """The destination bytes of inner chunk ``k`` when one request takes all of it contiguously."""
        parts = self.needs[k]
        if len(parts) != 1 or parts[0][0].sizes != self.meta.chunk_shape:
            return None
        part, req = parts[0]
        region = req.dest[part.relative_to(req.box.offsets).slices()]
        return region.data.cast("B") if region.flags.c_contiguous and region.size else None


@dataclass(frozen=True)
class Fetch:
    """One read of the byte range ``[start, end)`` of a shard object, and what it holds."""

    start: int
    end: int | None  # None: to the end of the object (an open range spares s3fs a HEAD for the size)
    index: bool = False  # it begins with the shard index
    chunks: tuple[int, ...] = ()  # inner chunks in it, each read whole and verified
    pieces: tuple[tuple[int, int, int], ...] = ()  # (chunk, start, end): bytes of a partly read chunk's elements
    anchors: tuple[int, ...] = ()  # partly read chunks whose stored crc32c (last 4 bytes) is in it
    direct: bool = False  # local files: read the chunks straight into their destinations

    def nbytes(self, layout: ShardLayout) -> int:
        return (layout.nbytes if self.end is None else self.end) - self.start


@dataclass(frozen=True)
class ShardRead:
    """The reads of one shard object, in order (the first holds the index)."""

    task: ShardTask
    layout: ShardLayout
    fetches: tuple[Fetch, ...]

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes(self.layout) for f in self.fetches)

    @property
    def reads_index(self) -> bool:
        """Whether a fetch holds the shard index (else chunks are checked by the commit record alone)."""
        return any(f.index for f in self.fetches)


def plan_reads(requests: Sequence[Request]) -> list[ShardTask]:
    """Group the inner chunks the requests need by shard."""
    tasks: dict[tuple[str, Shape], ShardTask] = {}
    for req in requests:
        meta = req.meta
        grid = chunks_per_shard(meta.shard_shape, meta.chunk_shape)
        for sidx in cells_in(req.box, meta.shard_shape):
            shard = cell_box(sidx, meta.shard_shape, meta.shape)
            inside = req.box.intersect(shard)
            if inside is None:
                continue
            task = tasks.setdefault((meta.key, sidx), ShardTask(meta, sidx))
            for cidx in cells_in(inside.relative_to(shard.offsets), meta.chunk_shape):
                origin = tuple(s + i * c for s, i, c in zip(shard.offsets, cidx, meta.chunk_shape, strict=True))
                part = inside.intersect(Box(origin, meta.chunk_shape))
                if part is not None:
                    k = flat_index(cidx, grid)
                    task.needs.setdefault(k, []).append((part, req))
    return list(tasks.values())


def plan_fetches(requests: Sequence[Request], caps: ReadCaps, *, partial: bool = False) -> list[ShardRead]:
    """What to read to fill every request: one :class:`ShardRead` per shard touched."""
    return [plan_shard(task, caps, partial) for task in plan_reads(requests)]


def plan_verify(meta: ArrayMeta, caps: ReadCaps) -> list[ShardRead]:
    """Reads that fetch and check every stored chunk of ``meta`` (copied nowhere)."""
    tasks = [ShardTask(meta, sidx) for sidx in cells_in(Box.full(meta.shape), meta.shard_shape)]
    for task in tasks:
        task.needs = {k: [] for k in ShardLayout.of(meta, task.index).stored}
    return [plan_shard(task, caps) for task in tasks]


def plan_shard(task: ShardTask, caps: ReadCaps, partial: bool = False) -> ShardRead:
    layout = ShardLayout.of(task.meta, task.index)
    # object stores, with the commit record: the committed layout gives every offset, and each chunk
    # read whole is checked against the crc32c committed for it, which the index cannot add to; the
    # index is read only to explain a failure
    recorded = bool(task.meta.committed_crc32c)
    skip_index = caps.per_request_cost and recorded
    # local files: a partly needed chunk is read whole and verified (cheap there); object stores: in
    # part, proven the committed chunk by its own stored crc32c (with the record) or the index (without)
    plans = _partial_plans(task, anchored=recorded) if partial and caps.per_request_cost else {}
    if plans:
        return ShardRead(task, layout, _ranged(task, layout, plans, with_index=not recorded))
    needed = sorted(task.needs)
    if caps.per_request_cost and reads_whole(layout, needed, caps):
        return ShardRead(task, layout, (Fetch(0, None, index=True, chunks=tuple(needed)),))
    fetches = [] if skip_index else [Fetch(0, layout.index_nbytes, index=True)]
    for run in _runs(needed, layout, caps):
        # local files: the chunks a request takes whole read straight into it, the others apart (a
        # rank's first and last chunk, where a shard object holds several ranks' rows, are partly its)
        for direct, group in itertools.groupby(run, lambda k: caps.vectored and task.direct_view(k) is not None):
            chunks = tuple(group)
            start, end = _offset(layout, chunks[0]), _offset(layout, chunks[-1]) + layout.chunk_nbytes
            fetches.append(Fetch(start, end, chunks=chunks, direct=direct))
    if len(fetches) > 1 and fetches[0].index and fetches[1].start == layout.index_nbytes:
        # the index and the chunks right behind it in one read (a small shard: one open, not two)
        fetches[:2] = [replace(fetches[1], start=0, index=True)]
    return ShardRead(task, layout, tuple(fetches))


def lazy_caps(caps: ReadCaps) -> ReadCaps:
    """``caps`` for a lazy view's reads, where bytes count more than requests (a notebook's link): a
    gap between needed chunks is read through only up to RANGE_MERGE_GAP, as between the pieces of
    a chunk (a column tile of each row band of a shard: one GET per tile, not the shard)."""
    return replace(caps, read_through_bytes=min(caps.read_through_bytes, RANGE_MERGE_GAP))


def reads_whole(layout: ShardLayout, needed: list[int], caps: ReadCaps) -> bool:
    """Object stores: whether a shard is fetched whole in one GET rather than index + ranged GETs.

    When every stored chunk is needed, or the object is small (one request costs more than the
    extra bytes), and it fits one request.
    """
    whole = layout.nbytes
    return whole <= caps.max_request_bytes and (tuple(needed) == layout.stored or whole <= SMALL_OBJECT_BYTES)


def _runs(needed: list[int], layout: ShardLayout, caps: ReadCaps) -> list[list[int]]:
    """Split needed chunk numbers (in storage order) into reads of at most ``caps.max_request_bytes``:
    chunks stored back to back, or at most ``caps.read_through_bytes`` apart (the gap is read and dropped)."""
    runs: list[list[int]] = []
    size = layout.chunk_nbytes
    for k in needed:
        at = _offset(layout, k)
        if runs:
            start, end = _offset(layout, runs[-1][0]), _offset(layout, runs[-1][-1]) + size
            if end <= at <= end + caps.read_through_bytes and at + size - start <= caps.max_request_bytes:
                runs[-1].append(k)
                continue
        runs.append([k])
    return runs


def _partial_plans(task: ShardTask, *, anchored: bool) -> dict[int, list[Range]]:
    """Byte ranges (within the chunk's elements) to read instead of the whole chunk, per inner chunk.

    A chunk is read in part only when that moves at most half its bytes, counting each extra
    request as RANGE_MERGE_GAP bytes, and, ``anchored``, everything from its first needed byte to
    its stored crc32c (read through, to check it against the commit record); otherwise it is read
    whole and verified.
    """
    meta = task.meta
    plans: dict[int, list[Range]] = {}
    for k, parts in task.needs.items():
        if not parts:
            continue
        _, origin = task.chunk_origin(k)
        ranges: list[Range] = []
        for part, _req in parts:
            rel = part.relative_to(origin)
            got = chunk_ranges(
                meta.chunk_shape, meta.itemsize, rel.offsets, rel.sizes, RANGE_MERGE_GAP, MAX_RANGES_PER_CHUNK
            )
            if got is None:
                break
            ranges += got
        else:
            merged = [(s, e) for s, e, _ in merge_ranges(ranges, RANGE_MERGE_GAP, MAX_REQUEST_BYTES)]
            cost = sum(e - s for s, e in merged) + (len(merged) - 1) * RANGE_MERGE_GAP
            if anchored:  # read from the first piece through the chunk's crc32c
                cost = meta.chunk_nbytes + 4 - merged[0][0]
            if len(merged) <= MAX_RANGES_PER_CHUNK and 2 * cost <= meta.chunk_nbytes + 4:
                plans[k] = merged
    return plans


_INDEX, _WHOLE, _PIECE, _ANCHOR = range(4)  # what a wanted byte range of a shard holds


def _ranged(
    task: ShardTask, layout: ShardLayout, plans: dict[int, list[Range]], *, with_index: bool
) -> tuple[Fetch, ...]:
    """The byte ranges of the chunks in ``plans``, the other needed chunks whole, and either the
    index (always in the first read) or, without it, the stored crc32c of every partly read chunk
    (its last 4 bytes: checked against the commit record, in the same read as the chunk's pieces);
    coalesced into few reads."""
    wants: list[tuple[int, int, int, int]] = []  # (start, end, what, chunk)
    if with_index:
        wants.append((0, layout.index_nbytes, _INDEX, -1))
    for k in sorted(task.needs):
        base = _offset(layout, k)
        end = base + layout.chunk_nbytes
        if k not in plans:
            wants.append((base, end, _WHOLE, k))
            continue
        wants += [(base + s, base + e, _PIECE, k) for s, e in plans[k]]
        if not with_index:
            wants.append((end - 4, end, _ANCHOR, k))
    # without the index, a chunk's pieces and its crc32c travel in one read: read through between them
    gap = RANGE_MERGE_GAP if with_index else max(RANGE_MERGE_GAP, layout.chunk_nbytes)
    fetches = []
    for start, end, members in merge_ranges([w[:2] for w in wants], gap, MAX_REQUEST_BYTES):
        got = [wants[i] for i in members]
        # a partly needed chunk whose bytes all arrive in this read anyway is read whole, and checked
        inside = {k for _, _, w, k in got if w == _PIECE and _offset(layout, k) >= start}
        inside = {k for k in inside if _offset(layout, k) + layout.chunk_nbytes <= end}
        pieces = tuple(
            (k, lo - _offset(layout, k), hi - _offset(layout, k))
            for lo, hi, w, k in got
            if w == _PIECE and k not in inside
        )
        fetches.append(
            Fetch(
                start,
                end,
                index=any(w == _INDEX for _, _, w, _ in got),
                chunks=tuple(sorted({k for _, _, w, k in got if w == _WHOLE} | inside)),
                pieces=pieces,
                anchors=tuple(k for _, _, w, k in got if w == _ANCHOR and k not in inside),
            )
        )
    return tuple(fetches)


def _offset(layout: ShardLayout, k: int) -> int:
    offset = layout.offset(k)
    assert offset is not None  # plans only hold stored chunks
    return offset
