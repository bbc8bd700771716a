"""The grid pass of a save plan: every tensor's grid, layout and metadata from who holds what (pure).

:func:`grid_pass` checks each tensor's holders (they agree, their boxes tile it exactly once) and
chooses its shard grid, inner chunks, first writers and constant; keys held alike (the same
holders of the very same specs) share one :class:`Layout`, made once. The writers pass and the
plan itself are :mod:`zarrckpt.plan.save`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zarrckpt.format import fill
from zarrckpt.format.array import ArrayMeta, beyond_limits
from zarrckpt.format.dtypes import storage_dtype
from zarrckpt.format.keys import infer_role
from zarrckpt.format.layout import (
    Box,
    ChunkRule,
    Claim,
    Shape,
    coverage_problems,
    holders_of_cells,
    inner_chunk_shape,
    owner_of_cells,
    shard_shape_for,
)
from zarrckpt.plan import perrank
from zarrckpt.plan.coarsen import Joins, coarse_shard
from zarrckpt.plan.rankdesc import TensorSpec
from zarrckpt.types import ArrayKind, Role

Holders = Mapping[str, tuple[list[int], list[TensorSpec]]]  # key -> (each part's holder, in rank order; the parts)


@dataclass(frozen=True)
class Grid:
    """What a tensor's holders imply (shared by every key with the same holders and boxes)."""

    shape: Shape
    shard: Shape
    chunk: Shape
    owners: dict[Shape, int]
    topology: dict[str, Any]
    replicated: bool
    holders: dict[Shape, tuple[int, ...]] = field(default_factory=dict)  # replicated: each cell's holders


@dataclass(frozen=True)
class Layout:
    """What the keys held alike (the same holders of the very same specs: a weight and its Adam
    moments) share: the grid, the constant, the stored shard and chunk shapes, the joined shards."""

    grid: Grid
    constant: bytes | None
    shard: Shape
    chunk: Shape
    joins: Joins | None  # small shards joined into ``shard`` (None: the grid's own shards)

    @functools.cached_property
    def too_many(self) -> str | None:
        """What makes the stored grid exceed the readers' limits (:func:`beyond_limits`); None: nothing."""
        return None if self.constant is not None else beyond_limits(self.grid.shape, self.shard, self.chunk)


class Layouts:
    """Every key's :class:`Layout`, made once per layout: found by the very same ``(ranks, specs)``
    lists (the layout-based planner's class tables share them: nothing to hash), else by equal
    holders of the same spec objects (a description shares one spec among equal parts). Keyed by
    identity: the ``Held`` table holds those lists and specs for as long as this lives."""

    def __init__(self) -> None:
        self._by_lists: dict[tuple[int, int], Layout] = {}
        self._by_holders: dict[tuple[tuple[int, ...], tuple[int, ...]], Layout] = {}

    def of(self, ranks: list[int], specs: list[TensorSpec], make: Callable[[], Layout | None]) -> Layout | None:
        """The layout of ``(ranks, specs)``: ``make()``'s when it is new (None: not made, not kept)."""
        lists = (id(ranks), id(specs))
        found = self._by_lists.get(lists)
        if found is None:
            holders = (tuple(ranks), tuple(map(id, specs)))
            found = self._by_holders.get(holders)
            if found is None:
                found = make()
                if found is None:
                    return None
                self._by_holders[holders] = found
            self._by_lists[lists] = found
        return found


def grid_pass(
    tensors: Holders, world_size: int, chunk_bytes: int | ChunkRule, small_tensor_bytes: int, problems: list[str]
) -> dict[str, tuple[ArrayMeta, Layout]]:
    """The grid pass: every tensor's metadata and layout, in key order; what is wrong is added to
    ``problems`` (past 50 of them, the keys left are skipped, but those of new layouts are checked)."""
    placed: dict[str, tuple[ArrayMeta, Layout]] = {}
    layouts = Layouts()
    for key in sorted(tensors):
        ranks, specs = tensors[key]

        def make(key: str = key, ranks: list[int] = ranks, specs: list[TensorSpec] = specs) -> Layout | None:
            found = _check(key, ranks, specs)
            problems.extend(found)
            if found or len(problems) > 50:
                return None
            return _layout(ranks, specs, world_size, chunk_bytes, small_tensor_bytes)

        layout = layouts.of(ranks, specs, make)
        if layout is None or len(problems) > 50:
            continue
        first, grid = specs[0], layout.grid
        meta = ArrayMeta.made(
            key=key,
            shape=grid.shape,
            dtype=first.dtype,
            shard_shape=layout.shard,
            chunk_shape=layout.chunk,
            role=infer_role(key, first.dtype.startswith(("float", "bfloat")))
            if first.kind == ArrayKind.TENSOR
            else Role.OTHER,
            kind=first.kind,
            topology=dict(grid.topology),
            python_type=first.python_type,
            constant=layout.constant,
            per_rank=first.per_rank,
        )
        placed[key] = meta, layout
        if layout.too_many:  # (once per layout)
            problems.append(
                f"{key}: {layout.too_many}, which readers refuse as a crafted layout; save with a larger chunk_bytes "
                f"(now {chunk_bytes}), or hold the tensor in fewer, larger parts"
            )
    return placed


def _layout(
    ranks: list[int], specs: list[TensorSpec], world_size: int, chunk_bytes: int | ChunkRule, small_tensor_bytes: int
) -> Layout:
    """The layout of holders that passed :func:`_check`: shards under ``small_tensor_bytes`` (of a
    tensor in several shards, not constant) are joined into a coarser grid."""
    grid = _grid(ranks, specs, world_size, chunk_bytes)
    dtype = specs[0].dtype
    constant = _constant(dtype, specs)
    if constant is None and len(grid.owners) > 1 and small_tensor_bytes and not specs[0].per_rank:  # (a row: a shard)
        itemsize = storage_dtype(dtype).itemsize
        coarse = coarse_shard(grid.shape, grid.shard, itemsize, small_tensor_bytes)
        if coarse != grid.shard:
            joins = Joins.of(grid.shape, grid.shard, coarse, grid.owners, ranks, specs, grid.replicated)
            return Layout(grid, constant, coarse, inner_chunk_shape(coarse, itemsize, chunk_bytes), joins)
    return Layout(grid, constant, grid.shard, grid.chunk, None)


def _constant(dtype: str, specs: list[TensorSpec]) -> bytes | None:
    """The element bytes of a tensor every part of which is the same constant (each holder checked
    its own parts, ``LocalTensor.constant``), stored as metadata only; else None."""
    found = {t.constant for t in specs}
    if len(found) != 1 or not specs[0].constant:
        return None
    try:
        bits = bytes.fromhex(specs[0].constant)
    except ValueError:
        return None
    return bits if len(bits) == storage_dtype(dtype).itemsize and fill.storable(dtype, bits) else None


def _check(key: str, ranks: list[int], specs: list[TensorSpec]) -> list[str]:
    """Problems with one tensor: holders that disagree, or boxes that do not tile it exactly once."""
    if any(t.per_rank for t in specs):
        if differ := perrank.row_problems(key, ranks, specs):
            return differ
        if perrank.exact_rows(ranks, specs):
            return []
    problems = []
    for field_ in ("shape", "dtype", "kind"):
        if len({getattr(t, field_) for t in specs}) > 1:
            detail = ", ".join(f"rank {r}: {getattr(t, field_)}" for r, t in zip(ranks, specs, strict=True))
            problems.append(f"{key}: ranks disagree on {field_} ({detail})")
    claims = [Claim(r, t.box) for r, t in zip(ranks, specs, strict=True)]
    return problems + coverage_problems(key, specs[0].shape, claims)


_chunk_of = functools.lru_cache(maxsize=4096)(inner_chunk_shape)  # many tensors share a shape


def _grid(ranks: list[int], specs: list[TensorSpec], world_size: int, chunk_bytes: int | ChunkRule) -> Grid:
    """Shard grid, inner chunks, writers and topology of a tensor whose holders passed :func:`_check`."""
    first = specs[0]
    shape = first.shape
    itemsize = storage_dtype(first.dtype).itemsize
    topology = {k: v for k, v in first.topology.items() if v is not None}
    topology.update(world_size=world_size, holders=len(set(ranks)))
    if shape and all(shape) and all(t.box == Box.full(shape) for t in specs):  # held whole, by one or replicas
        zero, replicated = (0,) * len(shape), len(specs) > 1
        holders = {zero: tuple(sorted(set(ranks)))} if replicated else {}  # (as holders_of_cells gives them)
        chunk = _chunk_of(shape, itemsize, chunk_bytes)
        return Grid(shape, shape, chunk, {zero: min(ranks)}, topology, replicated, holders)
    if perrank.exact_rows(ranks, specs):  # a row per rank, each a shard of its own
        shard = (1, *shape[1:])
        owners = {(r, *(0 for _ in shape[1:])): r for r in ranks}
        return Grid(shape, shard, _chunk_of(shard, itemsize, chunk_bytes), owners, topology, False)
    claims = [Claim(r, t.box) for r, t in zip(ranks, specs, strict=True)]
    shard = shard_shape_for(shape, [c.box for c in claims])
    chunk = _chunk_of(shard, itemsize, chunk_bytes)
    replicated = len({c.box for c in claims}) < len(claims)
    holders = holders_of_cells(shard, claims) if replicated else {}
    return Grid(shape, shard, chunk, owner_of_cells(shape, shard, claims), topology, replicated, holders)
