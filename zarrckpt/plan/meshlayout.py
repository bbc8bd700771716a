"""Every rank's box of a DTensor, from its layout alone (pure: no torch, no process group).

A DTensor's global shape, device mesh (shape and the rank at each coordinate) and placements
decide every mesh rank's local box, so one compact :class:`MeshLayout` per tensor replaces one
box per tensor and rank in what ranks exchange while planning a save
(:mod:`zarrckpt.plan.compact`). The arithmetic is torch's
(``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` for ``Shard`` and
``Replicate``): mesh dimensions are applied left to right, each ``Shard(d)`` cutting the current
local extent of dimension ``d`` into ``torch.chunk``-style pieces (``ceil(n / k)`` each, the last
ones shorter or empty; an empty piece sits at the end of the dimension). Placements it cannot
describe (``_StridedShard``, ``Partial``) are not layouts: their parts are described box by box.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zarrckpt.errors import SaveLayoutError
from zarrckpt.format.layout import Box, Shape

REPLICATE = -1  # a placement: ``Replicate()``; a tensor dimension ``d >= 0`` is ``Shard(d)``


def shard_piece(size: int, chunks: int, index: int) -> tuple[int, int]:
    """(start, length) of piece ``index`` of ``size`` elements cut into ``chunks`` as ``torch.chunk``
    does (DTensor's ``Shard``); a start relative to the cut extent."""
    if size % chunks == 0:
        step = size // chunks
        return step * index, step
    step = -(-size // chunks)
    start = min(size, step * index)
    return start, max(0, min(size, start + step) - start)


@dataclass(frozen=True)
class MeshLayout:
    """A tensor of ``shape`` laid out over a device mesh of ``mesh_shape`` whose coordinate ``c``
    (row-major) holds rank ``ranks[c]``, with one placement per mesh dimension."""

    shape: Shape
    mesh_shape: Shape
    ranks: tuple[int, ...]  # the rank at each mesh coordinate, row-major
    placements: tuple[int, ...]  # per mesh dimension: the sharded tensor dimension, or REPLICATE

    def __post_init__(self) -> None:
        if len(self.placements) != len(self.mesh_shape) or len(self.ranks) != math.prod(self.mesh_shape):
            raise SaveLayoutError(f"a mesh layout that does not fit its mesh: {self.to_json()}")
        if any(not REPLICATE <= p < len(self.shape) for p in self.placements):
            raise SaveLayoutError(f"a mesh layout shards a dimension the tensor lacks: {self.to_json()}")

    def box_at(self, coordinate: Sequence[int]) -> Box:
        """The box held at mesh ``coordinate``."""
        starts = [0] * len(self.shape)
        sizes = list(self.shape)
        empty = [False] * len(self.shape)
        for mesh_dim, dim in enumerate(self.placements):
            if dim == REPLICATE:
                continue
            start, size = shard_piece(sizes[dim], self.mesh_shape[mesh_dim], coordinate[mesh_dim])
            empty[dim] = empty[dim] or size == 0
            starts[dim] += start
            sizes[dim] = size
        offsets = tuple(self.shape[d] if empty[d] else starts[d] for d in range(len(self.shape)))
        return Box(offsets, tuple(sizes))

    def holders(self) -> list[tuple[int, Box]]:
        """(rank, box) at every mesh coordinate, in rank order."""
        out = []
        for flat, rank in enumerate(self.ranks):
            coordinate, rest = [], flat
            for n in reversed(self.mesh_shape):
                rest, c = divmod(rest, n)
                coordinate.append(c)
            out.append((rank, self.box_at(coordinate[::-1])))
        return sorted(out, key=lambda held: held[0])

    def boxes_of(self, ranks: Sequence[int]) -> list[Box]:
        """The box each of ``ranks`` holds (each must be in the mesh), computed for those ranks only."""
        position = dict(zip(self.ranks, range(len(self.ranks)), strict=True))
        out = []
        for rank in ranks:
            coordinate, rest = [], position[rank]
            for n in reversed(self.mesh_shape):
                rest, c = divmod(rest, n)
                coordinate.append(c)
            out.append(self.box_at(coordinate[::-1]))
        return out

    def box_of(self, rank: int) -> Box:
        """The box ``rank`` holds (it must be in the mesh)."""
        for held, box in self.holders():
            if held == rank:
                return box
        raise SaveLayoutError(f"rank {rank} is not in the mesh of {self.to_json()}")

    def to_json(self) -> dict[str, Any]:
        """Compact: the ranks as ``[start, strides...]`` when rank = start + coordinate . strides."""
        return {
            "mesh": list(self.mesh_shape),
            "ranks": compact_ranks(self.mesh_shape, self.ranks),
            "placements": list(self.placements),
        }

    @staticmethod
    def from_json(shape: Shape, doc: Any) -> MeshLayout:
        try:
            mesh = tuple(int(n) for n in doc["mesh"])
            return MeshLayout(shape, mesh, expand_ranks(mesh, doc["ranks"]), tuple(int(p) for p in doc["placements"]))
        except (KeyError, TypeError, ValueError) as e:
            raise SaveLayoutError(f"a rank sent a malformed mesh layout ({e!r})") from None


def compact_ranks(mesh_shape: Shape, ranks: Sequence[int]) -> dict[str, list[int]]:
    """``{"affine": [start, *strides]}`` when the rank grid is affine in the coordinate, else ``{"list": ranks}``."""
    strides = [math.prod(mesh_shape[i + 1 :]) for i in range(len(mesh_shape))]
    start = ranks[0] if ranks else 0
    steps = []
    for i, n in enumerate(mesh_shape):
        steps.append(ranks[strides[i]] - start if n > 1 else 0)
    affine = [start, *steps]
    return (
        {"affine": affine}
        if tuple(expand_ranks(mesh_shape, {"affine": affine})) == tuple(ranks)
        else {"list": list(ranks)}
    )


def expand_ranks(mesh_shape: Shape, doc: Any) -> tuple[int, ...]:
    """The row-major rank grid :func:`compact_ranks` describes."""
    if "list" in doc:
        return tuple(int(r) for r in doc["list"])
    start, *steps = (int(x) for x in doc["affine"])
    ranks = [start]
    for n, step in zip(mesh_shape, steps, strict=True):
        ranks = [r + i * step for r in ranks for i in range(n)]
    return tuple(ranks)
