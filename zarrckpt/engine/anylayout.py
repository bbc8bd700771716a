"""Read a shard whatever its layout (``allow_modified``): one another Zarr writer laid out, with
chunks in any order, gaps between them, or never written (the fill value). The index is read first,
then the chunks where it says, so such a read cannot be planned ahead; every chunk is still checked."""

from __future__ import annotations

import functools
import math

from zarrckpt.engine import shardcheck
from zarrckpt.engine.chunkcopy import copy_chunk, fill_value
from zarrckpt.errors import CorruptChunkError
from zarrckpt.format.shard import EMPTY, chunks_per_shard, index_nbytes
from zarrckpt.plan.fetch import MAX_REQUEST_BYTES, ShardTask
from zarrckpt.plan.ranges import Range, merge_ranges
from zarrckpt.storage.store import Storage


def read_any(storage: Storage, task: ShardTask) -> int:
    """Read one shard whatever its layout: chunks in any order, gaps between them, EMPTY entries
    (read as the fill value). Still checked: the index crc32c, each chunk's size (uncompressed),
    that it lies after the index and inside the object, and its crc32c."""
    meta = task.meta
    path = meta.shard_path(task.index)
    n_chunks = math.prod(chunks_per_shard(meta.shard_shape, meta.chunk_shape))
    head = index_nbytes(n_chunks)
    size = meta.chunk_nbytes + 4
    index = shardcheck.index_of(storage, path, n_chunks, meta.key)
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
        fetched += shardcheck.again(storage, path, functools.partial(_read_range, storage, task, start, end, parts))
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
