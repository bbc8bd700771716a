"""Byte ranges of a sub-box inside one uncompressed C-order inner chunk (pure math, no I/O).

Inner chunks are stored as raw little-endian C-order elements (FORMAT.md §5), so the bytes of
any element are at a computable offset and a reader can fetch just the part of a chunk it needs.
The ranges of a box are regular: one contiguous run per index of the outer dimensions, runs a
fixed stride apart; dimensions whose runs are at most ``gap`` bytes apart are folded into one
run (reading the gap costs less than another request).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from zarrckpt.format.layout import Shape

Range = tuple[int, int]  # [start, end) in bytes


def chunk_ranges(
    chunk_shape: Shape, itemsize: int, offsets: Shape, sizes: Shape, gap: int, limit: int
) -> list[Range] | None:
    """Sorted, disjoint byte ranges of a C-order chunk that hold every element of a box.

    The box is ``[offsets, offsets + sizes)`` relative to the chunk's origin and must lie inside
    the chunk. Ranges closer than ``gap`` bytes are merged; consecutive ranges of the result are
    more than ``gap`` bytes apart, each starts and ends on an element of the box. Returns None
    when there would be more than ``limit`` ranges (read the whole chunk instead).
    """
    if any(s == 0 for s in sizes):
        return []
    n = len(chunk_shape)
    if n == 0:
        return [(0, itemsize)]
    strides = [math.prod(chunk_shape[d + 1 :]) * itemsize for d in range(n)]
    start = offsets[-1] * itemsize
    length = sizes[-1] * itemsize
    level = n - 1  # dimensions [0, level) are enumerated, [level, n) folded into one run
    while level > 0:
        d = level - 1
        if sizes[d] > 1 and strides[d] - length > gap:
            break  # outer repeats are at least as far apart: nothing further out folds either
        start += offsets[d] * strides[d]
        length += (sizes[d] - 1) * strides[d]
        level = d
    count = math.prod(sizes[:level])
    if count > limit:
        return None
    starts = np.full(1, start, dtype=np.int64)
    for d in range(level):
        steps = (offsets[d] + np.arange(sizes[d], dtype=np.int64)) * strides[d]
        starts = (starts[:, None] + steps[None, :]).ravel()
    return [(int(s), int(s) + length) for s in starts]


def merge_ranges(ranges: Sequence[Range], gap: int, max_bytes: int) -> list[tuple[int, int, list[int]]]:
    """Group byte ranges into requests: ``(start, end, members)``, members being indices into ``ranges``.

    Ranges (in any order, possibly overlapping) join the current request when they start at most
    ``gap`` bytes after its end and the request stays within ``max_bytes``; an overlapping range
    always joins. A single range longer than ``max_bytes`` is a request of its own.
    """
    spans: list[tuple[int, int, list[int]]] = []
    for i in sorted(range(len(ranges)), key=lambda i: ranges[i]):
        lo, hi = ranges[i]
        if spans:
            s, e, members = spans[-1]
            if lo < e or (lo - e <= gap and max(e, hi) - s <= max_bytes):
                members.append(i)
                spans[-1] = (s, max(e, hi), members)
                continue
        spans.append((lo, hi, [i]))
    return spans
