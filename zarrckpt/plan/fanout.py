"""Read once, fan out: which rank reads each region several ranks need, and what it sends to whom (pure).

:func:`plan` takes every rank's read requests (array, box) and finds, per array, the groups of
overlapping boxes (identical boxes are replicas). A box no other rank's box overlaps is read by
its rank as before. Every other group is read by one of its ranks (spread over ranks by bytes,
largest first, to the least loaded), which sends each other holder its box; a group of
replicas larger than ``piece_bytes`` is cut into pieces along dimension 0, so that several
ranks read it: between shards, or at chunk rows inside shards too large to be read whole. One
rank reading a whole group (one storage read call) fetches each saved chunk it touches once,
partial overlaps included. Where shards are small enough to be read whole, groups touching a
common shard join when one of them is replicated, so that object is read once too. A constant
array (``ArrayInfo.constant``: no shard objects, every element its fill value) is never
exchanged: each rank fills its own requests of it locally, as in a plain load. With
``join_bytes`` (object stores), a shard object that boxes of several ranks meet in, one of them
in pieces, is read once for all (:mod:`zarrckpt.plan.fanjoin`); the parts of those boxes in other
objects their ranks read themselves (``FanOutPlan.solo_parts``).

The exchange runs in rounds that bound, per rank, the bytes read for others plus the bytes
received (``round_bytes``); items smaller than ``pack_bytes`` travel packed, one message per
reader and set of receivers per round. Nothing here does I/O or imports torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from zarrckpt.format.gcpause import gc_paused
from zarrckpt.format.layout import Box, Shape, cells_in
from zarrckpt.plan import fanjoin
from zarrckpt.plan.fetch import SMALL_OBJECT_BYTES

PIECE_BYTES = 16 * 1024 * 1024  # a replicated region larger than this is cut so that several ranks read it
ROUND_BYTES = 256 * 1024 * 1024  # per rank and round: bytes read for others plus bytes received
PACK_BYTES = 1024 * 1024  # items smaller than this are packed: one message per reader and receiver set


class Slot(NamedTuple):
    """One request of one rank: ``rank``'s request number ``request``."""

    rank: int
    request: int


class Part(NamedTuple):
    """The part ``region`` of request number ``request``."""

    request: int
    region: Box


@dataclass(frozen=True)
class ArrayInfo:
    """What planning needs of a saved array: its shape, shard and inner chunk shapes, element size,
    and whether it is constant (filled locally by each rank, never exchanged)."""

    shape: Shape
    shard_shape: Shape
    chunk_shape: Shape
    itemsize: int
    constant: bool = False

    def shard_nbytes(self, row: int) -> int:
        """The bytes of the smallest shard object holding row ``row`` of dimension 0 (shards are
        clipped at the array's edges)."""
        first = row - row % self.shard_shape[0]
        rows = min(self.shard_shape[0], self.shape[0] - first)
        last = [(n - 1) % s + 1 for s, n in zip(self.shard_shape[1:], self.shape[1:], strict=True)]
        return rows * math.prod(last) * self.itemsize


@dataclass(frozen=True)
class Item:
    """``region`` of array ``array``, read from storage by ``reader`` and sent to ``targets``.

    ``source`` is the reader's request whose destination holds ``region`` (-1: the region lies
    outside the reader's own boxes and is read into a scratch buffer). Each target's request box
    contains ``region``; a target on the reader itself (another request of the same box) is
    copied there, not sent.
    """

    array: int
    region: Box
    reader: int
    source: int
    targets: tuple[Slot, ...]
    nbytes: int


@dataclass(frozen=True)
class Message:
    """One transfer of a round: ``items`` (indices into the round's items), concatenated in that
    order, sent by ``src`` to each of ``dsts``."""

    src: int
    dsts: tuple[int, ...]
    items: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Round:
    """Reads, then transfers: every item is read by its reader before the messages move."""

    items: tuple[Item, ...]
    messages: tuple[Message, ...]


@dataclass(frozen=True)
class FanOutPlan:
    """The fanned-out read of every rank.

    Attributes:
        solo: per rank, the numbers of the requests it reads itself as before (with the first round).
        rounds: the rounds of reads for others and transfers.
        solo_parts: per rank, the parts of requests it reads itself (the rest of those requests
            arrives in the rounds); empty when no shard object was joined.
    """

    solo: tuple[tuple[int, ...], ...]
    rounds: tuple[Round, ...]
    solo_parts: tuple[tuple[Part, ...], ...] = ()

    def reads(self, rank: int, n: int) -> list[int]:
        """Indices of the items of round ``n`` that ``rank`` reads."""
        return [i for i, item in enumerate(self.rounds[n].items) if item.reader == rank]


@dataclass
class _Unit:
    """What one reader takes on at once: a group of overlapping boxes, or one piece of a replicated box."""

    array: int
    # distinct box (or piece) -> the slots holding it, and the request box of each slot
    boxes: dict[Box, list[tuple[Slot, Box]]]
    nbytes: int
    ranks: list[int]


@gc_paused()  # hundreds of thousands of boxes at 1,000 ranks, and no cycles
def plan(
    wants: Sequence[Sequence[tuple[int, Box]]],
    arrays: Sequence[ArrayInfo],
    *,
    piece_bytes: int = PIECE_BYTES,
    round_bytes: int = ROUND_BYTES,
    pack_bytes: int = PACK_BYTES,
    whole_bytes: int = SMALL_OBJECT_BYTES,
    join_bytes: int = 0,
) -> FanOutPlan:
    """Plan a fanned-out read.

    Args:
        wants: per rank, its requests in order: (index into ``arrays``, box of that array); a rank
            may request several parts of one array.
        arrays: the saved arrays the requests refer to.
        piece_bytes: a replicated box larger than this is cut along saved chunk rows into pieces
            about this big, read by different ranks.
        whole_bytes: a shard object this small is read whole (:mod:`zarrckpt.plan.fetch`), so a
            piece boundary never cuts through one.
        round_bytes: the bytes a rank reads for others plus those it receives, per round (a
            larger single piece gets a round of its own).
        pack_bytes: items smaller than this travel packed together.
        join_bytes: a shard object this small that several ranks' boxes meet in, one of them in
            pieces, is read once for all (:mod:`zarrckpt.plan.fanjoin`); 0: never.

    Returns:
        The plan; without a region that two ranks need (or a joined object), it has no rounds and
        every request is solo. Requests of constant arrays are always solo.

    Raises:
        ValueError: a request names an array not in ``arrays`` or a box of the wrong rank.
    """
    by_array: dict[int, dict[Box, list[Slot]]] = {}
    solo: list[list[int]] = [[] for _ in wants]
    solo_parts: list[list[Part]] = [[] for _ in wants]
    components: dict[tuple[Box, ...], list[list[int]]] = {}
    joins: dict[tuple[ArrayInfo, tuple[int, ...], tuple[Box, ...]], fanjoin.Joins] = {}
    for rank, reqs in enumerate(wants):
        for i, (array, box) in enumerate(reqs):
            if not 0 <= array < len(arrays) or len(box.offsets) != len(arrays[array].shape):
                raise ValueError(f"rank {rank} request {i}: {box} of array {array} does not fit the arrays given")
            if arrays[array].constant:  # filled locally: nothing to read, nothing to send
                solo[rank].append(i)
            elif box.volume:
                by_array.setdefault(array, {}).setdefault(box, []).append(Slot(rank, i))
    load = [0] * len(wants)
    units: list[_Unit] = []
    for array in sorted(by_array):
        info, distinct = arrays[array], by_array[array]
        boxes = tuple(distinct)
        if boxes not in components:  # the same boxes recur in arrays of one shape and sharding
            components[boxes] = _components(boxes)
        groups = components[boxes]
        largest = math.prod(min(c, n) for c, n in zip(info.shard_shape, info.shape, strict=True)) * info.itemsize
        if info.shape and largest <= whole_bytes:  # every shard is read whole: share them
            groups = _sharing_shards(groups, boxes, [len(distinct[b]) for b in boxes], info.shard_shape)
        alone: list[tuple[Slot, Box]] = []  # one box, one holder
        for group in groups:
            if len(group) == 1 and len(distinct[boxes[group[0]]]) == 1:
                alone.append((distinct[boxes[group[0]]][0], boxes[group[0]]))
                continue
            holders = {b: [(s, b) for s in distinct[b]] for b in (boxes[j] for j in group)}
            ranks = sorted({s[0] for slots in holders.values() for s, _ in slots})
            if len(holders) == 1:
                box, slots = next(iter(holders.items()))
                for piece in _pieces(box, info, piece_bytes, whole_bytes):
                    units.append(_Unit(array, {piece: slots}, piece.volume * info.itemsize, ranks))
            else:
                units.append(_Unit(array, holders, sum(b.volume for b in holders) * info.itemsize, ranks))
        owners, alone_boxes = tuple(slot[0] for slot, _ in alone), tuple(box for _, box in alone)
        key = (info, owners, alone_boxes)  # arrays of one shape and sharding (layers, moments) repeat
        if key not in joins:
            joins[key] = fanjoin.join(
                info.shape, info.shard_shape, info.chunk_shape, info.itemsize, owners, alone_boxes, join_bytes
            )
        joined, rest = joins[key].joined, joins[key].rest
        for n, ((rank, i), box) in enumerate(alone):
            parts = rest.get(n, [box])
            if n in rest:
                solo_parts[rank] += [Part(i, part) for part in parts]
            else:
                solo[rank].append(i)
            load[rank] += sum(p.volume for p in parts) * info.itemsize
        for j in joined:
            holders = {part: [alone[n]] for n, part in j.parts}
            ranks = sorted({owners[n] for n, _ in j.parts})
            units.append(_Unit(array, holders, sum(b.volume for b in holders) * info.itemsize, ranks))
    items_of: list[list[Item]] = []
    for unit in sorted(units, key=lambda u: (-u.nbytes, u.array, min(b.offsets for b in u.boxes))):
        reader = min(unit.ranks, key=lambda r: (load[r], r))
        load[reader] += unit.nbytes
        items_of.append(_items(unit, reader, arrays[unit.array].itemsize))
    rounds = _rounds(items_of, round_bytes)
    return FanOutPlan(
        tuple(tuple(sorted(s)) for s in solo),
        tuple(Round(tuple(items), _messages(items, pack_bytes)) for items in rounds),
        tuple(tuple(p) for p in solo_parts),
    )


def _order(box: Box) -> tuple[Shape, Shape]:
    return box.offsets, box.sizes


def _items(unit: _Unit, reader: int, itemsize: int) -> list[Item]:
    """The unit's items once ``reader`` reads it: one per distinct box (or piece)."""
    out = []
    for region in sorted(unit.boxes, key=_order):
        slots = unit.boxes[region]
        own = [i for (rank, i), box in slots if rank == reader and box.contains(region)]
        source = own[0] if own else -1
        targets = tuple(s for s, _ in slots if s != (reader, source))
        out.append(Item(unit.array, region, reader, source, targets, region.volume * itemsize))
    return out


def _components(boxes: Sequence[Box]) -> list[list[int]]:
    """Groups of boxes (indices) connected by overlaps, in order of their first member.

    A sweep along the dimension where the boxes' offsets differ most: only boxes whose
    intervals there overlap are compared.
    """
    parent = list(range(len(boxes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    ndim = len(boxes[0].offsets) if boxes else 0
    if ndim and len(boxes) > 1:
        d = max(range(ndim), key=lambda d: len({b.offsets[d] for b in boxes}))
        active: list[int] = []
        for i in sorted(range(len(boxes)), key=lambda i: boxes[i].offsets[d]):
            active = [j for j in active if boxes[j].ends[d] > boxes[i].offsets[d]]
            for j in active:
                if boxes[i].intersect(boxes[j]) is not None:
                    parent[root(i)] = root(j)
            active.append(i)
    elif len(boxes) > 1:  # 0-d: every box is the same one element
        parent = [0] * len(boxes)
    groups: dict[int, list[int]] = {}
    for i in range(len(boxes)):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


def _sharing_shards(
    groups: list[list[int]], boxes: Sequence[Box], holders: Sequence[int], shard: Shape
) -> list[list[int]]:
    """``groups`` (of ``boxes``) joined where they touch a common shard object (each read whole), when one
    of them has several holders: one rank then reads that object once for all. Groups of one holder
    each stay apart (a load without replicas exchanges nothing)."""
    parent = list(range(len(groups)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    shared = [sum(holders[j] for j in g) > 1 for g in groups]
    first: dict[tuple[int, ...], int] = {}  # shard -> the first shared group touching it
    for n, g in enumerate(groups):
        if shared[n]:
            for j in g:
                for cell in cells_in(boxes[j], shard):
                    parent[root(n)] = root(first.setdefault(cell, n))
    for n, g in enumerate(groups):  # one-holder groups join the shared groups on their shards
        if not shared[n]:
            for other in {first[c] for j in g for c in cells_in(boxes[j], shard) if c in first}:
                parent[root(n)] = root(other)
    merged: dict[int, list[int]] = {}
    for n, g in enumerate(groups):
        merged.setdefault(root(n), []).extend(g)
    return list(merged.values())


def _pieces(box: Box, info: ArrayInfo, piece_bytes: int, whole_bytes: int) -> list[Box]:
    """``box`` cut along its first dimension into pieces of about ``piece_bytes``: at shard
    boundaries, or at chunk rows inside shards larger than ``whole_bytes`` (smaller ones are read whole)."""
    nbytes = box.volume * info.itemsize
    if not box.offsets or nbytes <= piece_bytes:
        return [box]
    step, lo, hi = info.chunk_shape[0], box.offsets[0], box.ends[0]
    cuts = [  # chunk row boundaries inside the box that a piece may end at
        c
        for c in range((lo // step + 1) * step, hi, step)
        if c % info.shard_shape[0] == 0 or info.shard_nbytes(c) > whole_bytes
    ]
    want = min(len(cuts) + 1, math.ceil(nbytes / piece_bytes))
    if want <= 1:
        return [box]
    rows = hi - lo
    chosen = sorted({min(cuts, key=lambda c: abs(c - (lo + rows * k / want))) for k in range(1, want)})
    edges = [lo, *chosen, hi]
    return [Box((a, *box.offsets[1:]), (b - a, *box.sizes[1:])) for a, b in itertools.pairwise(edges) if b > a]


def _rounds(units: Sequence[Sequence[Item]], round_bytes: int) -> list[list[Item]]:
    """Units' items packed first-fit into rounds, each rank reading for others plus receiving at most
    ``round_bytes`` per round (a unit over the budget alone in a round of its own, as far as its ranks go)."""
    rounds: list[list[Item]] = []
    loads: list[dict[int, int]] = []
    for items in units:
        cost: dict[int, int] = {}
        for item in items:
            if item.targets or item.source < 0:
                cost[item.reader] = cost.get(item.reader, 0) + item.nbytes
            for rank in {r for r, _ in item.targets} - {item.reader}:
                cost[rank] = cost.get(rank, 0) + item.nbytes
        fits = (
            n
            for n, used in enumerate(loads)
            if all(not used.get(r) or used[r] + c <= round_bytes for r, c in cost.items())
        )
        n = next(fits, len(rounds))
        if n == len(rounds):
            rounds.append([])
            loads.append({})
        rounds[n].extend(items)
        for r, c in cost.items():
            loads[n][r] = loads[n].get(r, 0) + c
    return rounds


def _messages(items: Sequence[Item], pack_bytes: int) -> tuple[Message, ...]:
    """The transfers of one round: a message per large item, one per reader and receiver set for small ones."""
    out: list[Message] = []
    packs: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i, item in enumerate(items):
        dsts = tuple(sorted({r for r, _ in item.targets} - {item.reader}))
        if not dsts:
            continue
        if item.nbytes >= pack_bytes:
            out.append(Message(item.reader, dsts, (i,), item.nbytes))
        else:
            packs.setdefault((item.reader, dsts), []).append(i)
    for (src, dsts), members in packs.items():
        out.append(Message(src, dsts, tuple(members), sum(items[i].nbytes for i in members)))
    return tuple(out)
