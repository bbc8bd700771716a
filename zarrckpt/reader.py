"""Read regions of stored global tensors into host arrays, fetching only the inner chunks needed.

Plan per request box: the shards it touches, then the inner chunks inside them. Per shard, one
task: the whole object in one GET when every stored chunk is needed, else the index plus one
ranged GET per run of adjacent needed chunks. Every chunk's crc32c is checked before use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from . import dtypes
from .errors import CorruptChunkError
from .format import ArrayMeta
from .layout import Box, Shape, cell_box, cells_in
from .shard import EMPTY, chunk_indices, chunks_per_shard, decode_chunk, decode_index, index_nbytes
from .storage import Storage


@dataclass(frozen=True)
class Request:
    """Copy the global region ``box`` of ``meta`` into ``dest`` (an array of ``box.sizes``)."""

    meta: ArrayMeta
    box: Box
    dest: np.ndarray


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


def read_regions(storage: Storage, requests: Sequence[Request]) -> int:
    """Fill every request's ``dest``; returns the number of bytes fetched from storage."""
    return sum(storage.run_all(lambda t: _read_shard(storage, t), plan_reads(requests)))


def _stored_chunks(meta: ArrayMeta, sidx: Shape) -> list[int]:
    """Inner chunk numbers of a shard that lie (at least partly) inside the array."""
    shard = cell_box(sidx, meta.shard_shape, meta.shape)
    return [
        k
        for k, cidx in enumerate(chunk_indices(meta.shard_shape, meta.chunk_shape))
        if all(i * c < n for i, c, n in zip(cidx, meta.chunk_shape, shard.sizes, strict=True))
    ]


def _read_shard(storage: Storage, task: _ShardTask) -> int:
    meta = task.meta
    path = meta.shard_path(task.index)
    n_chunks = math.prod(chunks_per_shard(meta.shard_shape, meta.chunk_shape))
    head = index_nbytes(n_chunks)
    size = meta.chunk_nbytes + 4
    try:
        if sorted(task.needs) == _stored_chunks(meta, task.index):
            blob = memoryview(storage.read(path))
            index = decode_index(bytes(blob[:head]), n_chunks, storage.where(path), meta.key)
            fetched = len(blob)
            raw = {k: _slice(blob, index[k], size, meta, path, k) for k in task.needs}
        else:
            index = decode_index(storage.read(path, 0, head), n_chunks, storage.where(path), meta.key)
            fetched = head
            raw = {}
            for first, last in _runs(sorted(task.needs), index, size, meta, path):
                start = int(index[first][0])
                blob = memoryview(storage.read(path, start, int(index[last][0]) + size))
                fetched += len(blob)
                for k in range(first, last + 1):
                    if k in task.needs:
                        raw[k] = blob[int(index[k][0]) - start : int(index[k][0]) - start + size]
    except FileNotFoundError:
        raise CorruptChunkError(
            f"shard object {storage.where(path)} of {meta.key!r} is missing", key=meta.key, chunk=path
        ) from None
    grid = chunks_per_shard(meta.shard_shape, meta.chunk_shape)
    origin = cell_box(task.index, meta.shard_shape, meta.shape).offsets
    for k, parts in task.needs.items():
        cidx = tuple(int(i) for i in np.unravel_index(k, grid)) if grid else ()
        where = f"{path} (inner chunk {list(cidx)})"
        data = decode_chunk(raw[k], meta.chunk_nbytes, meta.key, where)
        chunk = np.frombuffer(data, dtype=dtypes.storage_dtype(meta.dtype)).reshape(meta.chunk_shape)
        chunk_origin = tuple(o + i * c for o, i, c in zip(origin, cidx, meta.chunk_shape, strict=True))
        for part, req in parts:
            req.dest[part.relative_to(req.box.offsets).slices()] = chunk[part.relative_to(chunk_origin).slices()]
    return fetched


def _check_entry(entry: np.ndarray, size: int, meta: ArrayMeta, path: str, k: int) -> int:
    offset, nbytes = int(entry[0]), int(entry[1])
    if offset == EMPTY or nbytes != size:
        state = "is missing from" if offset == EMPTY else f"has a wrong size ({nbytes} bytes) in"
        raise CorruptChunkError(
            f"inner chunk {k} of {meta.key!r} {state} shard {path}", key=meta.key, chunk=f"{path}#{k}"
        )
    return offset


def _slice(blob: memoryview, entry: np.ndarray, size: int, meta: ArrayMeta, path: str, k: int) -> memoryview:
    offset = _check_entry(entry, size, meta, path, k)
    return blob[offset : offset + size]


def _runs(needed: list[int], index: np.ndarray, size: int, meta: ArrayMeta, path: str) -> list[tuple[int, int]]:
    """Split needed chunk numbers into runs stored back to back (one ranged GET each)."""
    runs: list[tuple[int, int]] = []
    for k in needed:
        offset = _check_entry(index[k], size, meta, path, k)
        if runs and k == runs[-1][1] + 1 and offset == int(index[runs[-1][1]][0]) + size:
            runs[-1] = (runs[-1][0], k)
        else:
            runs.append((k, k))
    return runs
