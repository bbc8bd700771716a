"""Every rank's DTensor box from the layout alone (zarrckpt.plan.meshlayout), against torch's own arithmetic."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from zarrckpt.errors import SaveLayoutError
from zarrckpt.format.layout import Box
from zarrckpt.plan.meshlayout import REPLICATE, MeshLayout, compact_ranks, expand_ranks


@st.composite
def layouts(draw: st.DrawFn) -> MeshLayout:
    shape = tuple(draw(st.lists(st.integers(0, 13), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    placements = tuple(draw(st.sampled_from([REPLICATE, *range(len(shape))])) for _ in mesh)
    ranks = tuple(draw(st.permutations(range(math.prod(mesh)))))
    return MeshLayout(shape, mesh, ranks, placements)


def _torch_box(layout: MeshLayout, coordinate: tuple[int, ...]) -> Box:
    placements = [Replicate() if p == REPLICATE else Shard(p) for p in layout.placements]
    sizes, offsets = _compute_local_shape_and_global_offset(
        layout.shape, layout.mesh_shape, list(coordinate), placements
    )
    return Box(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_boxes_match_torch(layout: MeshLayout) -> None:
    coordinates = list(itertools.product(*(range(n) for n in layout.mesh_shape)))
    expected = sorted((layout.ranks[i], _torch_box(layout, c)) for i, c in enumerate(coordinates))
    assert layout.holders() == expected
    rank, box = expected[-1]
    assert layout.box_of(rank) == box


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_json_round_trip(layout: MeshLayout) -> None:
    assert MeshLayout.from_json(layout.shape, layout.to_json()) == layout


def test_affine_rank_grids_are_compact() -> None:
    ranks = tuple(4 + 8 * i + j for i in range(3) for j in range(4))  # a (3, 4) submesh of a larger job
    doc = compact_ranks((3, 4), ranks)
    assert doc == {"affine": [4, 8, 1]}
    assert expand_ranks((3, 4), doc) == ranks
    assert "list" in compact_ranks((2, 2), (0, 1, 3, 2))


def test_uneven_shards_end_empty() -> None:
    layout = MeshLayout((5,), (4,), (0, 1, 2, 3), (0,))  # torch.chunk: 2, 2, 1, 0
    assert [b for _, b in layout.holders()] == [Box((0,), (2,)), Box((2,), (2,)), Box((4,), (1,)), Box((5,), (0,))]


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(SaveLayoutError):
        MeshLayout((4,), (2,), (0, 1, 2), (0,))
    with pytest.raises(SaveLayoutError):
        MeshLayout((4,), (2,), (0, 1), (1,))
    with pytest.raises(SaveLayoutError):
        MeshLayout((4,), (2,), (0, 1), (0,)).box_of(5)
