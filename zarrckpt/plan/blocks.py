"""The save's replicated blocks, numbered alike on every rank, for the replica check's one MIN
all-reduce (pure): every rank sends a vector of all the save's blocks, its digests where it holds
one, whether or not its own plan lists others' blocks (:mod:`zarrckpt.plan.compact`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from zarrckpt.format.layout import Shape
from zarrckpt.plan.save import Held, ZarrSavePlan


def block_starts(tensors: Held, plan: ZarrSavePlan) -> tuple[int, dict[str, int]]:
    """The save's replicated blocks, numbered in key order, then offsets: their count, and the
    number of each replicated key's first block."""
    starts, n = {}, 0
    for key in sorted(plan.replicated):
        starts[key] = n
        n += len({spec.box.offsets for spec in tensors[key][1]})
    return n, starts


def block_index(tensors: Held, plan: ZarrSavePlan, starts: dict[str, int]) -> dict[tuple[str, Shape], int]:
    """(key, block offsets) -> the block's number, for the replicated keys of ``plan``."""
    return {
        (key, offsets): starts[key] + i
        for key in sorted(plan.replicated)
        for i, offsets in enumerate(sorted({spec.box.offsets for spec in tensors[key][1]}))
    }


def replica_vector(n: int, index: dict[tuple[str, Shape], int], digests: dict[str, list[list[Any]]]) -> np.ndarray:
    """This rank's crc32c of each replicated block it holds as ``[crc..., -crc...]`` (others 2**40):
    after a MIN all-reduce, block i's replicas agree when ``out[i] == -out[n + i]``."""
    out = np.full(2 * n, 2**40, dtype=np.int64)
    for key, held in digests.items():
        for offsets, crc in held:
            i = index[(key, tuple(offsets))]
            out[i], out[n + i] = crc, -crc
    return out
