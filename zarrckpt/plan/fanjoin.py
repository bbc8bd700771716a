"""Shard objects several ranks need disjoint parts of, each part in pieces: read once, by one of them (pure).

A request box no other rank's box overlaps is read by its own rank (:mod:`zarrckpt.plan.fanout`). When
the boxes of several ranks meet in one shard object and one of those parts is not a single run of
the object's inner chunks (C order, as stored), each rank would fetch that object in several
ranged GETs or read through the gaps, which are the other ranks' parts: the object's bytes would
move several times. A load into fewer expert-parallel ranks with more expert data-parallel ranks
does this to every expert shard: each rank wants a quarter of the rows of each of the two experts
in it. Instead, one of those ranks reads the parts for all in one read (the whole object, when the
parts cover it), and sends each other rank its part.

The parts of a joined box that lie in other shard objects are read by the box's own rank, as before.
Only objects of at most ``max_bytes`` are joined (one request reads them), and only on storage
where a request costs more than the bytes it saves (the caller decides: ``max_bytes=0`` joins
nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from zarrckpt.format.layout import Box, Shape, cell_box, cells_in


class BoxPart(NamedTuple):
    """The part ``region`` of box number ``box`` (an index into the boxes given to :func:`join`)."""

    box: int
    region: Box


@dataclass(frozen=True)
class Joined:
    """One shard object (grid cell ``cell``) read by one rank for all: the part of each box meeting in it."""

    cell: Shape
    parts: tuple[BoxPart, ...]


@dataclass(frozen=True)
class Joins:
    """What :func:`join` decided for an array's boxes.

    Attributes:
        joined: the shard objects read once for several ranks.
        rest: for each box touching a joined object, its parts in the other shard objects, which its
            own rank reads (possibly none); boxes touching none are absent.
    """

    joined: tuple[Joined, ...] = ()
    rest: dict[int, list[Box]] = field(default_factory=dict)


def join(
    shape: Shape,
    shard: Shape,
    chunk: Shape,
    itemsize: int,
    owners: Sequence[int],
    boxes: Sequence[Box],
    max_bytes: int,
) -> Joins:
    """Which shard objects of an array to read once for ``boxes`` (one holder each, the rank
    ``owners[i]``; no two overlap) where they meet.

    Returns the joined objects, and each of their boxes' parts in other shard objects.
    """
    if max_bytes <= 0 or not shape or all(box.sizes[1:] == shape[1:] for box in boxes):
        return Joins()  # whole in every dimension after the first: each part is one run (rows of the object)
    by_cell: dict[Shape, list[BoxPart]] = {}
    cells_of: list[list[Shape]] = []
    objects: dict[Shape, Box] = {}
    for n, box in enumerate(boxes):
        cells = list(cells_in(box, shard))
        cells_of.append(cells)
        for cell in cells:
            obj = objects.get(cell) or objects.setdefault(cell, cell_box(cell, shard, shape))
            part = box if len(cells) == 1 else box.intersect(obj)
            if part is not None:
                by_cell.setdefault(cell, []).append(BoxPart(n, part))
    joined = []
    for cell, parts in by_cell.items():
        if len(parts) < 2 or len({owners[n] for n, _ in parts}) < 2:
            continue
        obj = objects[cell]
        if obj.volume * itemsize <= max_bytes and any(not one_run(part, obj, chunk) for _, part in parts):
            joined.append(Joined(cell, tuple(parts)))
    taken: dict[int, set[Shape]] = {}
    for j in joined:
        for n, _ in j.parts:
            taken.setdefault(n, set()).add(j.cell)
    rest: dict[int, list[Box]] = {}
    for n, cells_taken in taken.items():
        inside = (boxes[n].intersect(objects[c]) for c in cells_of[n] if c not in cells_taken)
        rest[n] = [p for p in inside if p is not None]
    return Joins(tuple(joined), rest)


def one_run(part: Box, obj: Box, chunk: Shape) -> bool:
    """Whether the inner chunks of shard object ``obj`` (its box, clipped at the array's edge) that
    ``part`` touches are stored back to back: a C-order sub-grid that is whole in every dimension
    after the first one it spans more than one chunk of."""
    spans = False
    for start, end, origin, size, c in zip(part.offsets, part.ends, obj.offsets, obj.sizes, chunk, strict=True):
        lo, hi = (start - origin) // c, (end - 1 - origin) // c + 1
        if spans and (lo != 0 or hi != -(-size // c)):
            return False
        spans = spans or hi - lo > 1
    return True
