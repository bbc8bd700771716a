"""The global save plan, derived identically on every rank from all ranks' descriptions (no I/O)."""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zarrckpt.errors import SaveLayoutError
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.arraydoc import SPACED
from zarrckpt.format.gcpause import gc_paused
from zarrckpt.format.keys import validate_keys
from zarrckpt.format.layout import ChunkRule, Shape
from zarrckpt.format.manifest import group_json, group_paths
from zarrckpt.plan.coarsen import Gather
from zarrckpt.plan.grids import Layout, grid_pass
from zarrckpt.plan.rankdesc import RankDescription

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
DEFAULT_SMALL_TENSOR_BYTES = 2 * 1024 * 1024  # shards smaller than this are joined (a smaller tensor: one shard)


@dataclass(frozen=True)
class ZarrSavePlan:
    """What a save writes, the same on every rank: every array's metadata, which rank writes each of its
    shards, and the plain values. Not DCP's ``SavePlan`` (one rank's write items), which
    :class:`zarrckpt.ZarrWriter` turns into one of these."""

    arrays: dict[str, ArrayMeta]
    owners: dict[str, dict[Shape, int]]  # key -> shard grid index -> the one rank that writes it
    values: dict[str, Any]
    world_size: int
    replicated: frozenset[str] = frozenset()  # keys of which some block is held by several ranks
    gathers: Mapping[str, Mapping[Shape, Gather]] = field(default_factory=dict)  # key -> small shards joined
    docs: tuple[tuple[str, bytes], ...] | None = None  # this rank's zarr.json share, where it was handed one

    def chosen_writers(self) -> dict[str, list[int]]:
        """The writers :func:`plan_held` chose: key -> the writer of each shard, in ``owners`` order,
        of every tensor with joined or replicated shards (what a plan of some tensors only is given)."""
        return {k: list(self.owners[k].values()) for k in sorted(self.gathers.keys() | self.replicated)}

    def shards_of(self, rank: int) -> list[tuple[ArrayMeta, Shape]]:
        """The shards ``rank`` writes: (array, shard grid index) pairs."""
        return [(self.arrays[k], idx) for k, owner in self.owners.items() for idx, r in owner.items() if r == rank]

    def bytes_of(self, rank: int) -> int:
        """The data bytes of the shards ``rank`` writes (a save's progress total)."""
        return sum(_shard_bytes(m, idx) for m, idx in self.shards_of(rank))

    def total_bytes(self) -> int:
        """The data bytes of every shard of the save, whoever writes it (a plan that holds only some
        arrays: of those; rank 0's holds them all)."""
        return sum(_shard_bytes(self.arrays[k], idx) for k, owner in self.owners.items() for idx in owner)

    def metadata_of(self, rank: int) -> list[tuple[str, bytes]]:
        """The ``zarr.json`` documents (groups, then arrays) ``rank`` writes: spread round-robin (a
        plan that holds only some arrays was handed its rank's share, ``docs``)."""
        if self.docs is not None:
            return list(self.docs)
        return metadata_docs(list(self.arrays.values()), rank, self.world_size)


def _shard_bytes(meta: ArrayMeta, idx: Shape) -> int:
    """The data bytes of shard ``idx`` of ``meta`` (the array's, when it is one shard)."""
    if meta.shard_shape == meta.shape:
        return meta.nbytes
    n = meta.itemsize
    for i, s, extent in zip(idx, meta.shard_shape, meta.shape, strict=True):
        n *= min(s, extent - i * s)  # (the last shard along a dimension may be cut short)
    return n


def metadata_docs(arrays: list[ArrayMeta], rank: int = 0, world_size: int = 1) -> list[tuple[str, bytes]]:
    """Rank ``rank``'s round-robin share of the group and array ``zarr.json`` documents of ``arrays``."""
    nodes = [(p, None) for p in group_paths(arrays)] + [(a.path, a) for a in arrays]
    return _docs(nodes[rank::world_size])


def metadata_shares(arrays: list[ArrayMeta], world_size: int) -> list[list[tuple[str, bytes]]]:
    """Every rank's :func:`metadata_docs` share at once (the node list built once)."""
    nodes = [(p, None) for p in group_paths(arrays)] + [(a.path, a) for a in arrays]
    return [_docs(nodes[rank::world_size]) for rank in range(world_size)]


def _docs(nodes: Sequence[tuple[str, ArrayMeta | None]]) -> list[tuple[str, bytes]]:
    group = json.dumps(group_json()).encode()
    text = SPACED.text  # (json.dumps of each array's to_json(), from templates)
    return [(f"{path}/zarr.json", group if a is None else text(a).encode()) for path, a in nodes]


def build_save_plan(
    descriptions: Sequence[RankDescription],
    chunk_bytes: int | ChunkRule = DEFAULT_CHUNK_BYTES,
    small_tensor_bytes: int = 0,
) -> ZarrSavePlan:
    """Check that ranks agree and every global tensor is covered exactly once; choose grids and writers.

    ``descriptions[r]`` is rank r's ``LocalState.describe()``. Raises SaveLayoutError listing
    every problem found, before anything is written. Shards smaller than ``small_tensor_bytes``
    (an FSDP ``Shard(0)`` of a norm weight over 128 ranks) are joined into shards of at least that
    size, or the whole tensor when it is smaller, each written by one of the ranks holding a part
    of it (the one with the fewest bytes to write, see :func:`plan_held`) once the others sent it
    their parts (``ZarrSavePlan.gathers``); 0 keeps every part's shards.

    Keys whose holders hold the very same spec objects (a weight and its Adam moments, the same
    shard of every layer on a pipeline stage) are checked and gridded once.
    """
    with gc_paused():
        return _build(descriptions, chunk_bytes, small_tensor_bytes)


Held = dict[str, tuple[list[int], list[Any]]]  # key -> (the holder of each part or copy, in rank order; the parts)


def _build(
    descriptions: Sequence[RankDescription], chunk_bytes: int | ChunkRule, small_tensor_bytes: int
) -> ZarrSavePlan:
    tensors: Held = {}  # key -> (holder of each part, the parts)
    values: Held = {}
    for rank, desc in enumerate(descriptions):
        for key, parts in desc.tensors.items():
            for i in parts:
                _hold(tensors, key, rank, desc.specs[i])
        for key, v in desc.values.items():
            _hold(values, key, rank, v)
    return plan_held(tensors, values, len(descriptions), chunk_bytes, small_tensor_bytes)


def plan_held(
    tensors: Held,
    values: Held,
    world_size: int,
    chunk_bytes: int | ChunkRule,
    small_tensor_bytes: int,
    writers: Mapping[str, Sequence[int]] | None = None,
) -> ZarrSavePlan:
    """:func:`build_save_plan` from who holds what: ``tensors[key]`` lists each holder rank (rank
    order) and its :class:`TensorSpec`, ``values[key]`` each holder and its value. Equal inputs give
    equal plans however they were gathered (:mod:`zarrckpt.plan.compact` derives them from layouts).

    A shard that several ranks could write (a joined small shard: the owners of its cells; a
    replicated shard: its holders) goes to the one with the fewest bytes to write so far, the
    largest such shards first, after every shard only one rank can write: the ranks' bytes come out
    as even as the layout allows. ``writers`` given (a whole plan's :meth:`ZarrSavePlan.chosen_writers`):
    those, so that a plan of some tensors only (a rank's own) has the whole plan's writers."""
    with gc_paused():
        return _plan(tensors, values, world_size, chunk_bytes, small_tensor_bytes, writers)


def _plan(
    tensors: Held,
    values: Held,
    world_size: int,
    chunk_bytes: int | ChunkRule,
    small_tensor_bytes: int,
    writers: Mapping[str, Sequence[int]] | None,
) -> ZarrSavePlan:
    """The grid pass (every array's grid and metadata, every problem found), then the writers pass."""
    problems: list[str] = []
    _drop_empty_prefixes(values, tensors.keys() | values.keys())
    validate_keys(sorted(tensors.keys() | values.keys()))
    for key in sorted(tensors.keys() & values.keys()):
        problems.append(f"{key}: a tensor on ranks {tensors[key][0]} but a plain value on ranks {values[key][0]}")
    for key, (ranks, copies) in values.items():
        if len(set(map(repr, copies))) > 1:  # equal reprs: equal JSON; else compare as JSON
            distinct = {json.dumps(v, sort_keys=True) for v in copies}
            if len(distinct) > 1:
                problems.append(f"{key}: ranks {ranks} hold different values; give per-rank state per-rank keys")
    placed = grid_pass(tensors, world_size, chunk_bytes, small_tensor_bytes, problems)
    if problems:
        raise SaveLayoutError(
            "nothing was written: the ranks' state does not describe each global tensor exactly once:\n  "
            + "\n  ".join(problems[:50])
        )
    owners, replicated, gathers = _writers(placed, world_size, writers)
    arrays = {key: meta for key, (meta, _) in placed.items()}
    values_ = {k: v[1][0] for k, v in sorted(values.items())}
    return ZarrSavePlan(arrays, owners, values_, world_size, frozenset(replicated), gathers)


def _writers(
    placed: Mapping[str, tuple[ArrayMeta, Layout]], world_size: int, given: Mapping[str, Sequence[int]] | None
) -> tuple[dict[str, dict[Shape, int]], set[str], dict[str, dict[Shape, Gather]]]:
    """The writers pass: each shard's writer (``owners``, in key order), the replicated keys and the
    joined small shards (``gathers``); a shard several ranks could write goes to the least loaded
    (see :func:`plan_held`), or to its writer in ``given``."""
    owners: dict[str, dict[Shape, int]] = {}
    replicated: set[str] = set()
    open_: list[tuple[str, Mapping[Shape, Sequence[int]]]] = []  # keys whose shards have several candidates
    for key, (_, layout) in placed.items():
        grid = layout.grid
        if layout.constant is not None:  # a constant array: metadata only (equal constants are equal replicas)
            owners[key] = {}
            continue
        if grid.replicated:
            replicated.add(key)
        if layout.joins is not None:
            cells: Mapping[Shape, Sequence[int]] = layout.joins.candidates
        elif grid.replicated:
            cells = grid.holders
        else:
            owners[key] = grid.owners
            continue
        owners[key] = dict.fromkeys(cells, -1)  # (its place in key order; the writers come below)
        open_.append((key, cells))
    if given is not None:
        for key, cells in open_:
            owners[key] = dict(zip(cells, given[key], strict=True))
    else:
        _least_loaded(placed, owners, open_, world_size)
    gathers: dict[str, dict[Shape, Gather]] = {}
    for key, _ in open_:
        joins = placed[key][1].joins
        if joins is not None:
            gathers[key] = {idx: joins.gather(idx, writer) for idx, writer in owners[key].items()}
    return owners, replicated, gathers


def _least_loaded(
    placed: Mapping[str, tuple[ArrayMeta, Layout]],
    owners: dict[str, dict[Shape, int]],
    open_: list[tuple[str, Mapping[Shape, Sequence[int]]]],
    world_size: int,
) -> None:
    """Each shard of ``open_`` to the candidate with the fewest bytes so far (a tie: the first
    candidate, the lowest rank), the largest shards first (equal sizes in key order), after counting
    the shards ``owners`` already gives a writer (filled in place)."""
    if all(len(c) == 1 for _, cells in open_ for c in cells.values()):  # no choice to make
        for key, cells in open_:
            owners[key] = {idx: cands[0] for idx, cands in cells.items()}
        return
    load = [0] * world_size
    counted: dict[tuple[int, int], list[int]] = {}  # (id(the cells' dict), itemsize) -> bytes of each cell

    def sizes(meta: ArrayMeta, cells: Mapping[Shape, Any]) -> list[int]:  # (keys held alike share theirs)
        found = counted.get((id(cells), meta.itemsize))
        if found is None:
            found = counted[id(cells), meta.itemsize] = [_shard_bytes(meta, idx) for idx in cells]
        return found

    for key, owner in owners.items():
        if owner and next(iter(owner.values())) >= 0:  # (an open key's are -1 until chosen)
            for rank, nbytes in zip(owner.values(), sizes(placed[key][0], owner), strict=True):
                load[rank] += nbytes
    shards = [
        (-nbytes, n, key, idx, cands)
        for n, (key, cells) in enumerate(open_)
        for (idx, cands), nbytes in zip(cells.items(), sizes(placed[key][0], cells), strict=True)
    ]
    shards.sort(key=lambda s: s[:2])
    for minus_bytes, _, key, idx, cands in shards:
        writer = min(cands, key=load.__getitem__)
        load[writer] -= minus_bytes
        owners[key][idx] = writer


def _drop_empty_prefixes(values: Held, keys: set[str]) -> None:
    """An empty dict on some ranks where others hold keys under it (a full state dict kept by rank 0
    only, ``{}`` elsewhere) contributes nothing."""
    empty = [k for k, (_, copies) in values.items() if all(c == {} for c in copies)]
    if not empty:
        return
    ordered = sorted(keys)
    for key in empty:
        at = bisect.bisect_right(ordered, key + ".")
        if (at < len(ordered) and ordered[at].startswith(key + ".")) or (key + ".") in keys:
            del values[key]


def _hold(held: Held, key: str, rank: int, item: Any) -> None:
    entry = held.get(key)
    if entry is None:
        held[key] = ([rank], [item])
    else:
        entry[0].append(rank)
        entry[1].append(item)
