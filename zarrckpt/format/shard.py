"""Encode and decode one Zarr v3 ``sharding_indexed`` shard (index at the start, crc32c everywhere).

A shard object is: the index (``n`` pairs of little-endian uint64 ``(offset, nbytes)``, in C
order of the inner-chunk grid, then the crc32c of those bytes), followed by the inner chunks,
each the raw little-endian C-order elements of a full inner chunk then their crc32c.
Inner chunks that lie wholly outside the array are left out (offset = nbytes = 2**64-1).
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import crc32c

from zarrckpt.errors import CorruptChunkError
from zarrckpt.format.layout import Shape, cell_box, flat_index

if TYPE_CHECKING:
    import numpy as np

    from zarrckpt.format.array import ArrayMeta

EMPTY = 2**64 - 1
_CRC = struct.Struct("<I")
_ONE = struct.Struct("<QQ")  # the index of a shard of one inner chunk: its offset and size


def index_nbytes(n_chunks: int) -> int:
    return 16 * n_chunks + 4


def chunks_per_shard(shard_shape: Shape, chunk_shape: Shape) -> Shape:
    return tuple(s // c for s, c in zip(shard_shape, chunk_shape, strict=True))


def chunk_indices(shard_shape: Shape, chunk_shape: Shape) -> Iterator[Shape]:
    """Inner-chunk grid indices in C order (the order of the shard index)."""
    return itertools.product(*(range(n) for n in chunks_per_shard(shard_shape, chunk_shape)))


@dataclass(frozen=True)
class ShardLayout:
    """Where the parts of a shard object zarrckpt wrote lie: the index first, then every inner
    chunk inside the array, back to back in index order (FORMAT.md §5).

    Computed, not enumerated: a chunk's place follows from its grid index, so nothing here loops
    over the chunks a shard claims (a crafted manifest may claim 2**40 of them).
    """

    grid: Shape  # inner chunks per shard, per dimension (the index covers all of them)
    inside: Shape  # per dimension, the inner chunks (partly) inside the array: stored, back to back
    chunk_nbytes: int  # one stored inner chunk: its elements and their crc32c

    @classmethod
    def of(cls, meta: ArrayMeta, index: Shape) -> ShardLayout:
        shard = cell_box(index, meta.shard_shape, meta.shape)
        inside = tuple(-(-n // c) for n, c in zip(shard.sizes, meta.chunk_shape, strict=True))
        return cls(chunks_per_shard(meta.shard_shape, meta.chunk_shape), inside, meta.chunk_nbytes + 4)

    @property
    def n_chunks(self) -> int:
        """Inner chunks in the shard's grid: entries of its index."""
        return math.prod(self.grid)

    @property
    def n_stored(self) -> int:
        """Inner chunks stored in the object (those inside the array)."""
        return math.prod(self.inside)

    @property
    def index_nbytes(self) -> int:
        return index_nbytes(self.n_chunks)

    @property
    def nbytes(self) -> int:
        """The size of the whole object."""
        return self.index_nbytes + self.chunk_nbytes * self.n_stored

    @cached_property
    def stored(self) -> tuple[int, ...]:
        """The inner chunks (partly) inside the array, in index order (enumerates them: for plans
        that read them all, of shards whose size was checked)."""
        if self.inside == self.grid:
            return tuple(range(self.n_chunks))
        return tuple(flat_index(cell, self.grid) for cell in itertools.product(*map(range, self.inside)))

    @cached_property
    def _strides(self) -> tuple[int, ...]:
        """Index-order strides of the chunk grid (C order)."""
        return tuple(math.prod(self.grid[d + 1 :]) for d in range(len(self.grid)))

    def place(self, k: int) -> int | None:
        """Chunk ``k``'s place among the stored chunks (its order in the object); None outside the array."""
        if not 0 <= k < self.n_chunks:
            return None
        if self.inside == self.grid:  # every chunk inside the array: index order is object order
            return k
        place = 0
        for stride, kept in zip(self._strides, self.inside, strict=True):
            i, k = divmod(k, stride)
            if i >= kept:
                return None
            place = place * kept + i
        return place

    def offset(self, k: int) -> int | None:
        """Where inner chunk ``k`` starts; None for a chunk outside the array (not stored)."""
        j = self.place(k)
        return None if j is None else self.index_nbytes + j * self.chunk_nbytes

    def chunks_from(self, nbytes: int) -> int:
        """How many stored chunks (in object order) lie wholly in the first ``nbytes`` of the object."""
        return max(0, min(self.n_stored, (nbytes - self.index_nbytes) // self.chunk_nbytes))


def _checksum(buf: bytes | memoryview) -> bytes:
    return _CRC.pack(crc32c.crc32c(buf))


def encode_shard(data: np.ndarray, shard_shape: Shape, chunk_shape: Shape) -> list[bytes | memoryview]:
    """The byte parts of one shard object, in order; ``data`` is the in-bounds part of the shard.

    Inner chunks that are whole and contiguous in ``data`` are passed through without a copy.
    """
    if data.ndim and data.shape == tuple(chunk_shape) == tuple(shard_shape) and data.flags.c_contiguous:
        view = data.data.cast("B")  # one whole inner chunk (most small tensors): no index arithmetic
        raw_index = _ONE.pack(index_nbytes(1), len(view) + 4)
        return [raw_index + _checksum(raw_index), view, _checksum(view)]
    import numpy as np  # in the functions that move data: reading a manifest needs no numpy

    grid = chunks_per_shard(shard_shape, chunk_shape)
    index = np.full((math.prod(grid), 2), EMPTY, dtype="<u8")
    chunk_nbytes = math.prod(chunk_shape) * data.dtype.itemsize
    parts: list[bytes | memoryview] = [b""]
    offset = index_nbytes(len(index))
    for k, cidx in enumerate(itertools.product(*(range(n) for n in grid))):
        lo = [i * c for i, c in zip(cidx, chunk_shape, strict=True)]
        if any(lo_ >= n for lo_, n in zip(lo, data.shape, strict=True)):
            continue  # wholly outside the array: stays empty
        sl = tuple(slice(a, a + c) for a, c in zip(lo, chunk_shape, strict=True))
        piece = data[sl] if sl else data
        if piece.shape != chunk_shape or not piece.flags.c_contiguous:
            full = np.zeros(chunk_shape, dtype=data.dtype)
            full[tuple(slice(0, n) for n in piece.shape)] = piece
            piece = full
        view = piece.data.cast("B")
        parts += [view, _checksum(view)]
        index[k] = (offset, chunk_nbytes + 4)
        offset += chunk_nbytes + 4
    raw_index = index.tobytes()
    parts[0] = raw_index + _checksum(raw_index)
    return parts


def decode_index(raw: bytes, n_chunks: int, where: str, key: str) -> np.ndarray:
    """Parse and verify a shard index; returns an ``(n_chunks, 2)`` uint64 array."""
    if len(raw) != index_nbytes(n_chunks):
        raise CorruptChunkError(
            f"shard index of {key!r} at {where} is truncated ({len(raw)} of {index_nbytes(n_chunks)} bytes)",
            key=key,
            chunk=where,
        )
    if _checksum(raw[:-4]) != raw[-4:]:
        raise CorruptChunkError(f"shard index of {key!r} at {where} fails its crc32c checksum", key=key, chunk=where)
    import numpy as np

    return np.frombuffer(raw, dtype="<u8", count=2 * n_chunks).reshape(n_chunks, 2)


def decode_chunk(raw: bytes | memoryview, chunk_nbytes: int, key: str, where: str) -> memoryview:
    """Verify one stored inner chunk and return its element bytes (without the checksum)."""
    if len(raw) != chunk_nbytes + 4:
        raise CorruptChunkError(
            f"chunk {where} of {key!r} is truncated ({len(raw)} of {chunk_nbytes + 4} bytes)", key=key, chunk=where
        )
    view = memoryview(raw)
    if _checksum(view[:-4]) != bytes(view[-4:]):
        raise CorruptChunkError(
            f"chunk {where} of {key!r} fails its crc32c checksum: the stored bytes are corrupted", key=key, chunk=where
        )
    return view[:-4]


def chunk_crcs(parts: list[bytes | memoryview], n_chunks: int) -> bytes:
    """The crc32c of every inner chunk of a shard from :func:`encode_shard`'s parts: ``n_chunks``
    little-endian uint32 slots in index order, 0 for chunks outside the array."""
    if n_chunks == 1:  # (the index says whether the one chunk is there: parts beyond it)
        return bytes(parts[2]) if len(parts) > 2 else bytes(4)
    import numpy as np

    index = np.frombuffer(bytes(parts[0][:-4]), dtype="<u8").reshape(n_chunks, 2)
    out = bytearray(4 * n_chunks)
    for j, k in enumerate(np.flatnonzero(index[:, 0] != EMPTY)):
        out[4 * k : 4 * k + 4] = parts[2 + 2 * j]
    return bytes(out)
