"""Shard objects several ranks need disjoint parts of, each part in pieces: read once, by one of them (pure).

A request box no other rank's box overlaps is read by its own rank (:mod:`zarrckpt.fanout`). When
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
from dataclasses import dataclass

from .layout import Box, Shape, cell_box, cells_in

Slot = tuple[int, int]  # (rank, index of one of its requests)


@dataclass(frozen=True)
class Joined:
    """One shard object read by one rank for all: per slot, its request box and the part of it inside."""

    cell: Shape
    parts: tuple[tuple[Slot, Box, Box], ...]


def join(
    shape: Shape, shard: Shape, chunk: Shape, itemsize: int, solo: Sequence[tuple[Slot, Box]], max_bytes: int
) -> tuple[list[Joined], dict[Slot, list[Box]]]:
    """Which shard objects of an array to read once for the ``solo`` boxes (one holder each, no
    overlaps) that meet in them.

    Returns the joined objects, and for each slot whose box touches one: the parts of its box in
    the other shard objects, which its rank reads itself (possibly none).
    """
    if max_bytes <= 0 or not shape or all(box.sizes[1:] == shape[1:] for _, box in solo):
        return [], {}  # whole in every dimension after the first: each part is one run (rows of the object)
    by_cell: dict[Shape, list[tuple[Slot, Box, Box]]] = {}
    cells_of: dict[Slot, list[Shape]] = {}
    objects: dict[Shape, Box] = {}
    for slot, box in solo:
        cells = cells_of[slot] = list(cells_in(box, shard))
        for cell in cells:
            obj = objects.get(cell) or objects.setdefault(cell, cell_box(cell, shard, shape))
            part = box if len(cells) == 1 else box.intersect(obj)
            if part is not None:
                by_cell.setdefault(cell, []).append((slot, box, part))
    joined: list[Joined] = []
    for cell, parts in by_cell.items():
        if len(parts) < 2 or len({slot[0] for slot, _, _ in parts}) < 2:
            continue
        obj = objects[cell]
        if obj.volume * itemsize <= max_bytes and any(not one_run(part, obj, chunk) for _, _, part in parts):
            joined.append(Joined(cell, tuple(parts)))
    taken: dict[Slot, set[Shape]] = {}
    for j in joined:
        for slot, _, _ in j.parts:
            taken.setdefault(slot, set()).add(j.cell)
    rest: dict[Slot, list[Box]] = {}
    for slot, box in solo:
        if slot in taken:
            inside = (box.intersect(objects[c]) for c in cells_of[slot] if c not in taken[slot])
            rest[slot] = [p for p in inside if p is not None]
    return joined, rest


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
