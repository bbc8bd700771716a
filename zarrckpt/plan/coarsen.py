"""Small shards joined (pure): the coarser grid, and who sends what to each joined shard's writer.

A tensor whose shard grid (one shard per rank's box) gives shards under ``small_tensor_bytes``
gets a coarser grid: the cells joined along dimension 0 first, then the next, until a shard has
at least that many bytes (the whole tensor when it is smaller). Each joined shard is written by
one of the ranks owning one of its cells, the one with the fewest bytes to write so far
(:func:`zarrckpt.plan.save.plan_held` chooses over the whole save; the coordinator hands each
rank the writers of its tensors, :mod:`zarrckpt.plan.compact`); every other cell is sent to it by
its owner (:mod:`zarrckpt.engine.exchange` does the sending). Nothing here imports torch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from zarrckpt.format.layout import Box, Shape, cell_box
from zarrckpt.plan.rankdesc import TensorSpec


@dataclass(frozen=True)
class Gather:
    """One joined shard: the rank that writes it, and the regions it lacks with the rank that sends each."""

    writer: int
    pieces: tuple[tuple[Box, int], ...]


def coarse_shard(shape: Shape, cell: Shape, itemsize: int, target_bytes: int) -> Shape:
    """``cell`` joined, along dimension 0 first, until a shard holds ``target_bytes`` (or the whole
    extent of every dimension); unchanged when it already does."""
    shard = list(cell)
    for d, n in enumerate(shape):
        nbytes = math.prod(shard) * itemsize
        if nbytes >= target_bytes:
            break
        cells = -(-n // shard[d]) if n else 1
        shard[d] = max(1, min(n, shard[d] * min(cells, -(-target_bytes // max(nbytes, 1)))))
    return tuple(shard)


@dataclass(frozen=True)
class Joins:
    """A grid's joined shards: the cells of each (by its index in the coarse grid) with their owners,
    and every holder's boxes; shared by the keys with the same holders and boxes."""

    cells: dict[Shape, list[tuple[Box, int]]]
    held: dict[int, list[Box]] | None  # None: each cell is held by its owner alone (no replicas)
    _pieces: dict[tuple[Shape, int], tuple[tuple[Box, int], ...]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        shape: Shape,
        cell: Shape,
        coarse: Shape,
        cell_owners: dict[Shape, int],
        ranks: Sequence[int],
        specs: Sequence[TensorSpec],
        replicated: bool,
    ) -> Joins:
        held: dict[int, list[Box]] | None = None
        if replicated:
            held = {}
            for rank, spec in zip(ranks, specs, strict=True):
                held.setdefault(rank, []).append(spec.box)
        cells: dict[Shape, list[tuple[Box, int]]] = {}
        for idx in sorted(cell_owners):
            box = cell_box(idx, cell, shape)
            cells.setdefault(tuple(o // c for o, c in zip(box.offsets, coarse, strict=True)), []).append(
                (box, cell_owners[idx])
            )
        return cls(cells, held)

    @functools.cached_property
    def candidates(self) -> dict[Shape, list[int]]:
        """The ranks that may write each joined shard: the owners of its cells (made once, shared by
        the keys held alike)."""
        return {idx: sorted({owner for _, owner in inside}) for idx, inside in self.cells.items()}

    def gather(self, idx: Shape, writer: int) -> Gather:
        """The :class:`Gather` of joined shard ``idx`` when ``writer`` writes it."""
        pieces = self._pieces.get((idx, writer))
        if pieces is None:
            inside = self.cells[idx]
            if self.held is None:
                pieces = tuple((box, owner) for box, owner in inside if owner != writer)
            else:
                held = self.held[writer]
                pieces = tuple((box, owner) for box, owner in inside if not any(h.contains(box) for h in held))
            self._pieces[idx, writer] = pieces
        return Gather(writer, pieces)
