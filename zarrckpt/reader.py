"""Read regions of stored global tensors into host arrays, fetching only the inner chunks needed.

Plan per request box: the shards it touches, then the inner chunks inside them. Per shard, one
task: the whole object in one GET when every stored chunk is needed and it is small enough,
else the index plus one ranged GET per run of adjacent needed chunks (at most
MAX_REQUEST_BYTES each). Every chunk's crc32c is checked before use.

With ``partial=True`` (lazy views), an inner chunk of which only a small part is needed is not
read whole: only the byte ranges holding that part are fetched (chunks are uncompressed C-order
elements, see :mod:`zarrckpt.partial`), ranges at most RANGE_MERGE_GAP apart in one GET, the
shard index folded into the first GET when it is that close. Such a partial read cannot check
the chunk's crc32c (it covers the whole chunk); the shard index is still verified. Chunks read
whole are always verified.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import crc32c
import numpy as np

from . import dtypes, integrity
from .errors import CorruptChunkError, InvalidCheckpointError, ModifiedCheckpointError, ZarrckptError
from .format import ArrayMeta
from .layout import Box, Shape, cell_box, cells_in
from .partial import Range, chunk_ranges, coalesce
from .shard import EMPTY, chunk_indices, chunks_per_shard, decode_chunk, decode_index, index_nbytes
from .storage import Storage

MAX_REQUEST_BYTES = 8 * 1024 * 1024  # one GET fetches at most this much (bounds read buffers)
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


@dataclass
class _ShardTask:
    meta: ArrayMeta
    index: Shape
    # inner chunk number -> (part of the region inside that chunk, request it goes to)
    needs: dict[int, list[tuple[Box, Request]]] = field(default_factory=dict)


def plan_reads(requests: Sequence[Request]) -> list[_ShardTask]:
    """Group the inner chunks the requests need by shard (pure; no I/O)."""
    tasks: dict[tuple[str, Shape], _ShardTask] = {}
    for req in requests:
        meta = req.meta
        grid = chunks_per_shard(meta.shard_shape, meta.chunk_shape)
        for sidx in cells_in(req.box, meta.shard_shape):
            shard = cell_box(sidx, meta.shard_shape, meta.shape)
            inside = req.box.intersect(shard)
            if inside is None:
                continue
            task = tasks.setdefault((meta.key, sidx), _ShardTask(meta, sidx))
            for cidx in cells_in(inside.relative_to(shard.offsets), meta.chunk_shape):
                origin = tuple(s + i * c for s, i, c in zip(shard.offsets, cidx, meta.chunk_shape, strict=True))
                part = inside.intersect(Box(origin, meta.chunk_shape))
                if part is not None:
                    k = int(np.ravel_multi_index(cidx, grid)) if grid else 0
                    task.needs.setdefault(k, []).append((part, req))
    return list(tasks.values())


def allocate(meta: ArrayMeta) -> np.ndarray:
    """A host buffer for a whole stored array (bytes values, DCP byte items)."""
    try:
        return np.empty(meta.shape, dtype=dtypes.storage_dtype(meta.dtype))
    except (MemoryError, ValueError) as e:
        raise InvalidCheckpointError(
            f"{meta.key!r} claims {meta.nbytes} bytes, more than can be allocated here ({e}); the checkpoint "
            "metadata is probably corrupted"
        ) from None


def read_regions(
    storage: Storage, requests: Sequence[Request], *, partial: bool = False, any_layout: bool = False
) -> int:
    """Fill every request's ``dest``; returns the number of bytes fetched from storage.

    ``partial``: fetch only the needed byte ranges of inner chunks that are needed in small part,
    at the price of not checking those chunks' crc32c (see the module docstring).
    ``any_layout``: read shards laid out by any Zarr writer (``allow_modified``), see :func:`_read_any`.
    """
    return sum(storage.run_all(lambda t: _read_shard(storage, t, partial, any_layout), plan_reads(requests)))


def verify_array(storage: Storage, meta: ArrayMeta, *, any_layout: bool = False) -> int:
    """Read every stored chunk of ``meta`` and check the shard indexes and every checksum (and,
    when the manifest has a commit record, that each chunk is the one committed).

    Returns the bytes fetched; raises CorruptChunkError for the first problem found.
    """
    tasks = []
    for sidx in cells_in(Box.full(meta.shape), meta.shard_shape):
        task = _ShardTask(meta, sidx)
        task.needs = {k: [] for k in _stored_chunks(meta, sidx)}  # checked, copied nowhere
        tasks.append(task)
    return sum(storage.run_all(lambda t: _read_shard(storage, t, False, any_layout), tasks))


def _stored_chunks(meta: ArrayMeta, sidx: Shape) -> list[int]:
    """Inner chunk numbers of a shard that lie (at least partly) inside the array."""
    shard = cell_box(sidx, meta.shard_shape, meta.shape)
    return [
        k
        for k, cidx in enumerate(chunk_indices(meta.shard_shape, meta.chunk_shape))
        if all(i * c < n for i, c, n in zip(cidx, meta.chunk_shape, shard.sizes, strict=True))
    ]


def _read_shard(storage: Storage, task: _ShardTask, partial: bool = False, any_layout: bool = False) -> int:
    try:
        if any_layout:
            return _read_any(storage, task)
        plans = _partial_plans(task) if partial else {}
        return _read_ranges(storage, task, plans) if plans else _read_chunks(storage, task)
    except FileNotFoundError:
        path = task.meta.shard_path(task.index)
        raise CorruptChunkError(
            f"shard object {storage.where(path)} of {task.meta.key!r} is missing", key=task.meta.key, chunk=path
        ) from None


def _read_chunks(storage: Storage, task: _ShardTask) -> int:
    """Read and verify the needed inner chunks of one shard, each whole."""
    meta = task.meta
    path = meta.shard_path(task.index)
    n_chunks = math.prod(chunks_per_shard(meta.shard_shape, meta.chunk_shape))
    head = index_nbytes(n_chunks)
    size = meta.chunk_nbytes + 4
    needed = sorted(task.needs)
    stored = _stored_chunks(meta, task.index)
    # chunks sit back to back after the index, in index order (FORMAT.md §5): anything else is corrupt
    layout = {k: head + i * size for i, k in enumerate(stored)}
    if not storage.local and reads_whole(head, size, needed, stored):
        # an open range (start=0) spares s3fs a HEAD for the object's size
        with storage.reading(path, 0) as blob:
            index = decode_index(bytes(blob[:head]), n_chunks, storage.where(path), meta.key)
            for k in needed:
                offset = _check_entry(index[k], size, layout, meta, path, k)
                _copy_chunk(task, k, blob[offset : offset + size], path)
            return len(blob)
    with storage.reading(path, 0, head) as raw_index:
        index = decode_index(bytes(raw_index), n_chunks, storage.where(path), meta.key)
    for k in needed:
        _check_entry(index[k], size, layout, meta, path, k)
    fetched = head
    for run in _runs(needed, layout, size):
        start = int(index[run[0]][0])
        direct = [_direct_view(task, k) for k in run] if storage.local else []
        if direct and all(v is not None for v in direct):
            fetched += _read_direct(storage, task, path, start, run, direct)
            continue
        with storage.reading(path, start, int(index[run[-1]][0]) + size) as blob:
            fetched += len(blob)
            for k in run:
                offset = int(index[k][0]) - start
                _copy_chunk(task, k, blob[offset : offset + size], path)
    return fetched


def _read_any(storage: Storage, task: _ShardTask) -> int:
    """Read one shard whatever its layout: chunks in any order, gaps between them, EMPTY entries
    (read as the fill value). Still checked: the index crc32c, each chunk's size (uncompressed),
    that it lies after the index and inside the object, and its crc32c."""
    meta = task.meta
    path = meta.shard_path(task.index)
    n_chunks = math.prod(chunks_per_shard(meta.shard_shape, meta.chunk_shape))
    head = index_nbytes(n_chunks)
    size = meta.chunk_nbytes + 4
    with storage.reading(path, 0, head) as raw_index:
        index = decode_index(bytes(raw_index), n_chunks, storage.where(path), meta.key)
    ranges: list[Range] = []
    chunks: list[int] = []
    for k in sorted(task.needs):
        offset, nbytes = int(index[k][0]), int(index[k][1])
        if offset == EMPTY and nbytes == EMPTY:  # never written: the fill value (zero bits)
            _scatter(task, k, np.zeros(meta.chunk_shape, dtype=dtypes.storage_dtype(meta.dtype)))
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
    for start, end, members in coalesce(ranges, 0, MAX_REQUEST_BYTES):
        with storage.reading(path, start, end) as blob:
            fetched += len(blob)
            if len(blob) < end - start:
                raise CorruptChunkError(
                    f"shard object {storage.where(path)} of {meta.key!r} is shorter than its index says: bytes "
                    f"{start}..{end} hold {len(blob)} of {end - start} bytes (truncated)",
                    key=meta.key,
                    chunk=path,
                )
            for i in members:
                lo, hi = ranges[i]
                _copy_chunk(task, chunks[i], blob[lo - start : hi - start], path)
    return fetched


def reads_whole(head: int, size: int, needed: list[int], stored: list[int]) -> bool:
    """Object stores: whether a shard is fetched whole in one GET rather than index + ranged GETs.

    When every stored chunk is needed, or the object is small (one request costs more than the
    extra bytes), and it fits one request. Pure: the scale model counts requests with it.
    """
    whole = head + size * len(stored)
    return whole <= MAX_REQUEST_BYTES and (needed == stored or whole <= SMALL_OBJECT_BYTES)


def _chunk_origin(meta: ArrayMeta, sidx: Shape, k: int) -> tuple[Shape, Shape]:
    """(grid index, global origin) of inner chunk ``k`` of shard ``sidx``."""
    grid = chunks_per_shard(meta.shard_shape, meta.chunk_shape)
    cidx = tuple(int(i) for i in np.unravel_index(k, grid)) if grid else ()
    shard_origin = cell_box(sidx, meta.shard_shape, meta.shape).offsets
    return cidx, tuple(o + i * c for o, i, c in zip(shard_origin, cidx, meta.chunk_shape, strict=True))


def _partial_plans(task: _ShardTask) -> dict[int, list[Range]]:
    """Byte ranges (within the chunk's elements) to read instead of the whole chunk, per inner chunk.

    A chunk is read in part only when that moves at most half its bytes, counting each extra
    request as RANGE_MERGE_GAP bytes; otherwise it is read whole and verified.
    """
    meta = task.meta
    plans: dict[int, list[Range]] = {}
    for k, parts in task.needs.items():
        if not parts:
            continue
        _, origin = _chunk_origin(meta, task.index, k)
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
            merged = [(s, e) for s, e, _ in coalesce(ranges, RANGE_MERGE_GAP, MAX_REQUEST_BYTES)]
            cost = sum(e - s for s, e in merged) + (len(merged) - 1) * RANGE_MERGE_GAP
            if len(merged) <= MAX_RANGES_PER_CHUNK and 2 * cost <= meta.chunk_nbytes + 4:
                plans[k] = merged
    return plans


def _read_ranges(storage: Storage, task: _ShardTask, plans: dict[int, list[Range]]) -> int:
    """Read one shard's index, the byte ranges of the chunks in ``plans`` and the other needed chunks
    whole, coalesced into few GETs; the index (always in the first GET) is checked before any use."""
    meta = task.meta
    path = meta.shard_path(task.index)
    n_chunks = math.prod(chunks_per_shard(meta.shard_shape, meta.chunk_shape))
    head = index_nbytes(n_chunks)
    size = meta.chunk_nbytes + 4
    layout = {k: head + i * size for i, k in enumerate(_stored_chunks(meta, task.index))}
    wants: list[tuple[int, int, int]] = [(0, head, -1)]  # (start, end, inner chunk or -1: the index)
    for k in sorted(task.needs):
        base = layout[k]
        wants += [(base + s, base + e, k) for s, e in plans[k]] if k in plans else [(base, base + size, k)]
    # per partly read chunk: the bytes from its first to its last range (gaps left unfilled)
    scratch = {k: (ranges[0][0], np.empty(ranges[-1][1] - ranges[0][0], dtype=np.uint8)) for k, ranges in plans.items()}
    fetched = 0
    for start, end, members in coalesce([w[:2] for w in wants], RANGE_MERGE_GAP, MAX_REQUEST_BYTES):
        with storage.reading(path, start, end) as blob:
            fetched += len(blob)
            if len(blob) < end - start:
                raise CorruptChunkError(
                    f"shard object {storage.where(path)} of {meta.key!r} is truncated "
                    f"({start + len(blob)} bytes, needed {end})",
                    key=meta.key,
                    chunk=path,
                )
            for i in members:  # in order of start: the index comes first
                lo, hi, k = wants[i]
                piece = blob[lo - start : hi - start]
                if k < 0:
                    index = decode_index(bytes(piece), n_chunks, storage.where(path), meta.key)
                    for needed in task.needs:
                        _check_entry(index[needed], size, layout, meta, path, needed)
                elif k in plans:
                    first, buf = scratch[k]
                    at = lo - layout[k] - first
                    buf[at : at + hi - lo] = np.frombuffer(piece, dtype=np.uint8)
                else:
                    _copy_chunk(task, k, piece, path)
    dtype = dtypes.storage_dtype(meta.dtype)
    strides = tuple(math.prod(meta.chunk_shape[d + 1 :]) * dtype.itemsize for d in range(len(meta.chunk_shape)))
    for k, (first, buf) in scratch.items():
        _, origin = _chunk_origin(meta, task.index, k)
        for part, req in task.needs[k]:
            rel = part.relative_to(origin)
            offset = sum(o * st for o, st in zip(rel.offsets, strides, strict=True)) - first
            # the part as a strided view of the fetched bytes (numpy checks it lies inside them)
            src = np.ndarray(rel.sizes, dtype=dtype, buffer=buf, offset=offset, strides=strides)
            req.dest[part.relative_to(req.box.offsets).slices()] = src
    return fetched


def _direct_view(task: _ShardTask, k: int) -> memoryview | None:
    """The destination bytes of inner chunk ``k`` when one request takes all of it contiguously."""
    parts = task.needs[k]
    if len(parts) != 1 or parts[0][0].sizes != task.meta.chunk_shape:
        return None
    part, req = parts[0]
    region = req.dest[part.relative_to(req.box.offsets).slices()]
    return region.data.cast("B") if region.flags.c_contiguous and region.size else None


def _read_direct(
    storage: Storage, task: _ShardTask, path: str, start: int, run: list[int], views: list[memoryview | None]
) -> int:
    """Read a run of whole chunks straight into their destinations (one vectored read), then verify."""
    crcs = [bytearray(4) for _ in run]
    buffers = [b for view, crc in zip(views, crcs, strict=True) for b in (view, memoryview(crc))]
    got = storage.read_into(path, start, buffers)  # type: ignore[arg-type]
    for k, view, crc in zip(run, views, crcs, strict=True):
        assert view is not None
        where = f"{path} (inner chunk {k})"
        if got < len(view) + 4:
            raise CorruptChunkError(f"chunk {where} of {task.meta.key!r} is truncated", key=task.meta.key, chunk=where)
        got -= len(view) + 4
        if crc32c.crc32c(view) != int.from_bytes(crc, "little"):
            raise CorruptChunkError(
                f"chunk {where} of {task.meta.key!r} fails its crc32c checksum: the stored bytes are corrupted",
                key=task.meta.key,
                chunk=where,
            )
        integrity.check_chunk(task.meta, task.index, k, crc, where)
    return sum(len(v) + 4 for v in views if v is not None)


def _copy_chunk(task: _ShardTask, k: int, raw: memoryview, path: str) -> None:
    """Verify inner chunk ``k`` and copy the parts the requests need into their destinations."""
    meta = task.meta
    cidx, _ = _chunk_origin(meta, task.index, k)
    where = f"{path} (inner chunk {list(cidx)})"
    data = decode_chunk(raw, meta.chunk_nbytes, meta.key, where)
    integrity.check_chunk(meta, task.index, k, raw[-4:], where)
    _scatter(task, k, np.frombuffer(data, dtype=dtypes.storage_dtype(meta.dtype)).reshape(meta.chunk_shape))


def _scatter(task: _ShardTask, k: int, chunk: np.ndarray) -> None:
    """Copy the parts of inner chunk ``k`` (its elements, ``chunk``) that requests need into place."""
    _, origin = _chunk_origin(task.meta, task.index, k)
    for part, req in task.needs[k]:
        req.dest[part.relative_to(req.box.offsets).slices()] = chunk[part.relative_to(origin).slices()]


def _check_entry(entry: np.ndarray, size: int, layout: dict[int, int], meta: ArrayMeta, path: str, k: int) -> int:
    """The offset of inner chunk ``k``, after checking its index entry against the shard layout."""
    offset, nbytes = int(entry[0]), int(entry[1])
    if offset == EMPTY or nbytes != size:
        state = "is missing from" if offset == EMPTY else f"has a wrong size ({nbytes} bytes) in"
    elif offset != layout.get(k):
        state = f"is stored at offset {offset}, not {layout.get(k)}, in"
    else:
        return offset
    # the index passed its crc32c: someone wrote this layout on purpose
    raise ModifiedCheckpointError(
        f"inner chunk {k} of {meta.key!r} {state} shard {path}: the shard is not laid out as zarrckpt wrote it, "
        f"so it was modified after commit by another writer; {integrity.ALLOW_HINT}",
        key=meta.key,
        chunk=f"{path}#{k}",
    )


def _runs(needed: list[int], layout: dict[int, int], size: int) -> list[list[int]]:
    """Split needed chunk numbers into runs stored back to back, each one ranged GET of bounded size."""
    runs: list[list[int]] = []
    for k in needed:
        last = runs[-1][-1] if runs else None
        if last is not None and layout[k] == layout[last] + size and (len(runs[-1]) + 1) * size <= MAX_REQUEST_BYTES:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs
