"""Pure layout math: boxes, exactly-once coverage, shard grids, inner chunks.

Nothing here does I/O or imports torch, zarr or fsspec.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from zarrckpt.errors import ZarrckptError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle ``[offsets, offsets + sizes)`` of a global tensor."""

    offsets: Shape
    sizes: Shape

    @functools.cached_property
    def ends(self) -> Shape:  # cached: planners compare many boxes many times
        return tuple(map(operator.add, self.offsets, self.sizes))

    @property
    def volume(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes, or None when they do not overlap (or one is empty)."""
        if len(self.offsets) != len(other.offsets):
            raise ValueError(f"boxes of {len(self.offsets)} and {len(other.offsets)} dimensions do not intersect")
        lo = tuple(map(max, self.offsets, other.offsets))
        sizes = tuple(map(operator.sub, map(min, self.ends, other.ends), lo))
        if sizes and min(sizes) <= 0:
            return None
        return Box(lo, sizes)

    def contains(self, other: Box) -> bool:
        """Whether all of ``other`` lies inside this box."""
        inside = zip(self.offsets, other.offsets, other.ends, self.ends, strict=True)
        return all(lo <= o and e <= hi for lo, o, e, hi in inside)

    def relative_to(self, origin: Shape) -> Box:
        return Box(tuple(o - r for o, r in zip(self.offsets, origin, strict=True)), self.sizes)

    def slices(self) -> tuple[Any, ...]:
        """Index for numpy/torch; the trailing Ellipsis keeps 0-d results arrays, not scalars."""
        return (*(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True)), Ellipsis)

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{e}" for o, e in zip(self.offsets, self.ends, strict=True)) + "]"

    @staticmethod
    def full(shape: Sequence[int]) -> Box:
        return Box((0,) * len(shape), tuple(shape))


@dataclass(frozen=True)
class Claim:
    """One rank's claim to hold a box of a global tensor."""

    rank: int
    box: Box


def coverage_problems(key: str, shape: Shape, claims: Sequence[Claim], limit: int = 5) -> list[str]:
    """Check that the distinct claimed boxes tile ``shape`` exactly once.

    Identical boxes claimed by several ranks are replicas (allowed). Returns human-readable
    problems (uncovered or doubly covered regions, boxes outside the tensor); empty when fine.
    """
    problems: list[str] = []
    if claims and all(shape) and all(c.box == Box.full(shape) for c in claims):
        return problems  # one rank holds it whole, or every holder a replica of all of it: nothing to count
    if not shape:  # a 0-d tensor: treat as one element
        shape, claims = (1,), [Claim(c.rank, Box((0,), (1,))) for c in claims if not c.box.offsets]
    full = Box.full(shape)
    distinct: dict[Box, list[int]] = {}
    for c in claims:
        if len(c.box.offsets) != len(shape):
            problems.append(f"{key}: rank {c.rank} claims {c.box}, which has the wrong rank for shape {list(shape)}")
            continue
        if any(o < 0 or e > n for o, e, n in zip(c.box.offsets, c.box.ends, shape, strict=True)):
            problems.append(f"{key}: rank {c.rank} claims {c.box}, outside the global shape {list(shape)}")
            continue
        if c.box.volume:
            distinct.setdefault(c.box, []).append(c.rank)
    if problems or full.volume == 0:
        return problems
    # Count coverage on the grid of elementary intervals spanned by all box boundaries.
    ends = {box: box.ends for box in distinct}
    cuts = [
        sorted({0, n} | {b.offsets[d] for b in distinct} | {e[d] for e in ends.values()}) for d, n in enumerate(shape)
    ]
    pos = [{cut: i for i, cut in enumerate(dim)} for dim in cuts]
    spans = {
        box: tuple(slice(pos[d][box.offsets[d]], pos[d][ends[box][d]]) for d in range(len(shape))) for box in distinct
    }
    if len(distinct) == math.prod(len(c) - 1 for c in cuts) and all(
        s.stop - s.start == 1 for idx in spans.values() for s in idx
    ):
        return problems  # as many distinct boxes as grid cells, each box one cell: an exact tiling
    import numpy as np  # only here: reading a manifest (`zarrckpt ls`) does not import numpy

    counts = np.zeros([len(c) - 1 for c in cuts], dtype=np.int32)
    owners = np.full(counts.shape, -1, dtype=np.int64)
    for box, ranks in distinct.items():
        idx = spans[box]
        clash = counts[idx] > 0
        if clash.any():
            cell = tuple(int(i[0]) for i in np.nonzero(clash))
            other = int(owners[tuple(s.start + c for s, c in zip(idx, cell, strict=True))])
            region = _cell_box(cuts, tuple(s.start + c for s, c in zip(idx, cell, strict=True)))
            problems.append(
                f"{key}: region {region} is claimed twice (by rank {min(ranks)} with box {box} and by rank {other})"
            )
        counts[idx] += 1
        owners[idx] = min(ranks)
    for cell in zip(*np.nonzero(counts == 0), strict=True):
        problems.append(f"{key}: region {_cell_box(cuts, tuple(int(c) for c in cell))} is held by no rank")
        if len(problems) >= limit:
            break
    return problems[:limit]


def _cell_box(cuts: list[list[int]], cell: tuple[int, ...]) -> Box:
    return Box(
        tuple(cuts[d][i] for d, i in enumerate(cell)),
        tuple(cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell)),
    )


def shard_shape_for(shape: Shape, boxes: Sequence[Box]) -> Shape:
    """The coarsest regular grid whose every cell lies inside one of ``boxes``.

    Per dimension, the cell size is the gcd of all interior box boundaries (the full extent
    when there are none). Zero-length dimensions get cell size 1 (Zarr needs chunks >= 1).
    """
    cell = []
    nonempty = {b for b in boxes if b.volume}
    for d, n in enumerate(shape):
        cuts = {b.offsets[d] for b in nonempty} | {b.offsets[d] + b.sizes[d] for b in nonempty}
        interior = [c for c in cuts if 0 < c < n]
        cell.append(max(1, math.gcd(*interior) if interior else n))
    return tuple(cell)


STACKED_SLICE_BYTES = 64 * 1024  # a stacked (>= 3-d) array's slices this large are chunks of their own
CHUNKS_PER_SHARD = 8  # a shard is cut into about this many inner chunks when it is at most 8x the target ...
MIN_SPLIT_BYTES = 256 * 1024  # ... down to inner chunks of this size (smaller shards stay one chunk)
COLUMN_TILES = 8  # chunk policy "tiles": a 2-D row band is cut into up to this many column tiles ...
MIN_TILE_BYTES = 256 * 1024  # ... of at least this size
CHUNK_POLICIES = ("rows", "tiles")


@dataclass(frozen=True)
class ChunkRule:
    """How a save cuts shards into inner chunks (FORMAT.md §4): about ``target_bytes`` each
    (:func:`chunk_target`), and with ``policy="tiles"`` the row bands of 2-D shards cut into
    column tiles too (:func:`column_tiles`). Plans take it, or a plain ``int`` (``policy="rows"``)."""

    target_bytes: int
    policy: str = "rows"

    def __post_init__(self) -> None:
        if self.policy not in CHUNK_POLICIES:
            raise ZarrckptError(
                f"chunk_policy must be one of {', '.join(map(repr, CHUNK_POLICIES))}, not {self.policy!r}"
            )

    def __str__(self) -> str:
        return f"{self.target_bytes}, chunk_policy={self.policy!r}"


def chunk_rule(chunk_bytes: int, policy: str) -> int | ChunkRule:
    """What a plan takes for ``save(chunk_bytes=..., chunk_policy=...)``: the plain byte target for
    the default policy (so a default plan is the one it always was), a :class:`ChunkRule` otherwise."""
    rule = ChunkRule(chunk_bytes, policy)
    return chunk_bytes if policy == "rows" else rule


def chunk_target(shard_bytes: int, target_bytes: int) -> int:
    """The inner-chunk size aimed at for a shard of ``shard_bytes``: ``target_bytes``, or less so
    that a shard of a few targets is still cut into about :data:`CHUNKS_PER_SHARD` inner chunks
    (not below :data:`MIN_SPLIT_BYTES`). A load into another layout reads whole inner chunks, so a
    reshard boundary inside a shard wastes one inner chunk: an eighth of the shard, not all of it."""
    return min(target_bytes, max(MIN_SPLIT_BYTES, shard_bytes // CHUNKS_PER_SHARD))


def inner_chunk_shape(shard: Shape, itemsize: int, rule: int | ChunkRule) -> Shape:
    """Split ``shard`` into inner chunks of about ``rule``'s target bytes (at most; :func:`chunk_target`).

    Outer dimensions are split first (so one expert / one row block stays contiguous) and every
    chunk extent divides the shard extent, as Zarr's sharding codec requires. When a dimension
    has no divisor near the wanted extent (a large prime, say), it is kept whole and the next
    dimension is split instead; a 1-D shard of prime length stays one chunk.

    A shard of 3 or more dimensions is a stack (experts, layers, heads): each slice along the
    first dimension of at least STACKED_SLICE_BYTES is a chunk of its own (or several), so that
    reading one expert reads whole chunks, each checked by its crc32c, in one request.

    With the policy "tiles", a 2-D row band is then cut into column tiles (:func:`column_tiles`).
    """
    rule = rule if isinstance(rule, ChunkRule) else ChunkRule(rule)
    chunk = list(shard)
    target_bytes = chunk_target(math.prod(shard) * itemsize, rule.target_bytes)
    if len(chunk) >= 3 and math.prod(chunk[1:]) * itemsize >= STACKED_SLICE_BYTES:
        chunk[0] = 1
    for d in range(len(chunk)):
        nbytes = math.prod(chunk) * itemsize
        if nbytes <= target_bytes:
            break
        step = max(nbytes // chunk[d], 1)  # bytes per index along dimension d
        lower, upper = _divisors_around(shard[d], max(1, target_bytes // step))
        # the divisor below unless that makes chunks 8x smaller than the target (in bytes, not
        # in rounded-down extents); then the one above, and the next dimension splits further
        chunk[d] = lower if lower * step * 8 >= target_bytes else upper
    return column_tiles(shard, tuple(chunk), itemsize) if rule.policy == "tiles" else tuple(chunk)


def column_tiles(shard: Shape, chunk: Shape, itemsize: int) -> Shape:
    """Cut a 2-D row band (``chunk`` as wide as ``shard``) into column tiles, so that a column slice
    of a row-sharded matrix reads a fraction of each shard, not all of it.

    The rows stay as they are (a reshard boundary across rows costs what it did: one band), and
    the columns are split into at most :data:`COLUMN_TILES` tiles of at least
    :data:`MIN_TILE_BYTES`: the tile width is the smallest divisor of the shard's width that is at
    least width / tiles (a prime width stays whole). Anything else is returned as it is.
    """
    if len(shard) != 2 or chunk[1] != shard[1]:
        return chunk
    rows, width = chunk
    tiles = min(COLUMN_TILES, rows * width * itemsize // MIN_TILE_BYTES)
    if tiles < 2:
        return chunk
    _, cols = _divisors_around(width, -(-width // tiles))
    return (rows, cols)


def _divisors_around(n: int, want: int) -> tuple[int, int]:
    """The largest divisor of ``n`` that is <= ``want`` and the smallest that is >= ``want``."""
    lower, upper = 1, n
    for i in range(1, math.isqrt(n) + 1):
        if n % i == 0:
            for div in (i, n // i):
                if lower < div <= want:
                    lower = div
                if want <= div < upper:
                    upper = div
    return lower, upper


def grid_shape(shape: Shape, cell: Shape) -> Shape:
    """Number of grid cells per dimension (edge cells may be partial)."""
    return tuple(-(-n // c) for n, c in zip(shape, cell, strict=True))


def flat_index(index: Shape, grid: Shape) -> int:
    """The number of grid cell ``index`` in C order (``numpy.ravel_multi_index``; ValueError outside)."""
    flat = 0
    for i, n in zip(index, grid, strict=True):
        if not 0 <= i < n:
            raise ValueError(f"cell {index} is outside the grid {grid}")
        flat = flat * n + i
    return flat


def cell_box(index: Shape, cell: Shape, shape: Shape) -> Box:
    """The part of grid cell ``index`` that lies inside the array (clipped at the edge)."""
    offsets = tuple(i * c for i, c in zip(index, cell, strict=True))
    return Box(offsets, tuple(min(c, n - o) for o, c, n in zip(offsets, cell, shape, strict=True)))


def cells_in(box: Box, cell: Shape) -> Iterator[Shape]:
    """Indices of the grid cells that ``box`` touches, in C order."""
    if box.volume == 0:
        return
    ranges = [range(o // c, (e - 1) // c + 1) for o, e, c in zip(box.offsets, box.ends, cell, strict=True)]
    yield from itertools.product(*ranges)


def holders_of_cells(cell: Shape, claims: Sequence[Claim]) -> dict[Shape, tuple[int, ...]]:
    """Every grid cell some claim contains, and the ranks whose claims contain it (ascending)."""
    holders: dict[Shape, list[int]] = {}
    for c in sorted(claims, key=lambda c: c.rank):
        for idx in cells_in(c.box, cell):
            held = holders.setdefault(idx, [])
            if not held or held[-1] != c.rank:
                held.append(c.rank)
    return {idx: tuple(held) for idx, held in holders.items()}


def owner_of_cells(shape: Shape, cell: Shape, claims: Sequence[Claim]) -> dict[Shape, int]:
    """Assign each grid cell to the lowest rank whose claimed box contains it (the plan spreads replicated
    cells over :func:`holders_of_cells` instead)."""
    owner: dict[Shape, int] = {}
    for c in sorted(claims, key=lambda c: c.rank):
        for idx in cells_in(c.box, cell):
            owner.setdefault(idx, c.rank)
    return owner
