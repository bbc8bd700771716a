"""A load into another layout reads little more than it needs: the bytes the real read planner
fetches for a 4 -> 3 ranks ``Shard(0)`` reshard of the benchmark's model (benchmarks/common.py), on
local files and on object stores, against the bytes the 3 ranks' regions hold (pure; no I/O)."""

from __future__ import annotations

import numpy as np
import pytest

from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.layout import MIN_SPLIT_BYTES, Box, chunk_target, inner_chunk_shape
from zarrckpt.plan.fetch import Request, plan_fetches
from zarrckpt.plan.save import DEFAULT_CHUNK_BYTES
from zarrckpt.storage.caps import LOCAL_FILES, OBJECT_STORE, ReadCaps


def model_shapes(h: int) -> list[tuple[int, ...]]:
    """The 2-D weights of benchmarks/common.py's model (2 layers): what a reshard splits."""
    return [(8 * h, h)] + 2 * [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)]


def rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """DTensor's Shard(0) split: ceil(n / world) rows per rank, the last ranks short."""
    per = -(-n // world)
    return min(rank * per, n), min((rank + 1) * per, n)


def reshard_bytes(shape: tuple[int, ...], caps: ReadCaps, save: int = 4, load: int = 3) -> tuple[int, int]:
    """(bytes planned, bytes needed) for every load rank's region of a ``save``-rank Shard(0) array."""
    shard = (-(-shape[0] // save), *shape[1:])
    meta = ArrayMeta("w", shape, "float32", shard, inner_chunk_shape(shard, 4, DEFAULT_CHUNK_BYTES))
    meta = ArrayMeta(**{**meta.__dict__, "committed_crc32c": b"\0" * 4})  # a committed checkpoint's record
    planned = needed = 0
    for rank in range(load):
        lo, hi = rows(shape[0], load, rank)
        box = Box((lo, *([0] * (len(shape) - 1))), (hi - lo, *shape[1:]))
        dest = np.empty(box.sizes, dtype=np.float32)  # never touched: no memory
        planned += sum(r.nbytes for r in plan_fetches([Request(meta, box, dest)], caps))
        needed += box.volume * 4
    return planned, needed


@pytest.mark.parametrize("caps", [LOCAL_FILES, OBJECT_STORE], ids=["local", "object-store"])
@pytest.mark.parametrize("h", [832, 1472, 4160])  # the bench's S3 (256 MiB), local (2 GiB) and a larger state
def test_a_4_to_3_reshard_reads_at_most_1_10x_what_it_needs(h: int, caps: ReadCaps) -> None:
    planned = needed = 0
    for shape in model_shapes(h):
        p, n = reshard_bytes(shape, caps)
        planned, needed = planned + p, needed + n
    assert planned / needed <= 1.10, (h, planned / needed)


def test_one_inner_chunk_per_shard_was_the_waste() -> None:
    """The same reshard with a shard per inner chunk (the rule before) reads a third more: the
    test above would catch a return to it."""
    shape = (4 * 832, 832)
    shard = (shape[0] // 4, shape[1])
    meta = ArrayMeta("w", shape, "float32", shard, shard, committed_crc32c=b"\0" * 4)
    planned = needed = 0
    for rank in range(3):
        lo, hi = rows(shape[0], 3, rank)
        box = Box((lo, 0), (hi - lo, shape[1]))
        planned += sum(
            r.nbytes for r in plan_fetches([Request(meta, box, np.empty(box.sizes, np.float32))], LOCAL_FILES)
        )
        needed += box.volume * 4
    assert planned / needed > 1.3


def test_chunk_target() -> None:
    mib = 1024 * 1024
    assert chunk_target(64 * mib, 4 * mib) == 4 * mib  # large shards: the target
    assert chunk_target(4 * mib, 4 * mib) == 512 * 1024  # a shard of one target: 8 inner chunks
    assert chunk_target(mib, 4 * mib) == MIN_SPLIT_BYTES  # not below 256 KiB
    assert chunk_target(100, 4 * mib) == MIN_SPLIT_BYTES  # (a shard under it is one chunk anyway)
    assert chunk_target(64 * mib, 64 * 1024) == 64 * 1024  # an explicit smaller chunk_bytes wins
    assert inner_chunk_shape((832, 832), 4, 4 * mib) == (104, 832)  # 2.6 MiB: 8 inner chunks
