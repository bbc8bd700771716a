"""Save planning whose per-rank traffic does not grow with the job: layouts, not boxes (issue 28).

Pure: what each step sends and what it makes of what it received, as bytes and objects;
:func:`zarrckpt.engine.saveplan.plan_compact` runs the collectives.

Instead of every rank all-gathering every rank's description (``O(world)`` bytes per rank), ranks
are grouped into *classes*: ranks whose DTensors have the same layouts (:mod:`.meshlayout`: global
shape, mesh, placements), e.g. the ranks of one pipeline stage. The collectives:

A. all-gather of a 16-byte digest of each rank's layout document (``16 x world`` bytes): the classes;
B. each class's lowest rank broadcasts its whole document (layouts, plain tensors, values);
C. one MIN all-reduce of one flag per item of those documents: the items *every* member of a class
   holds identically (a step counter, the hyperparameters) are the class's common items;
D. what is left on a rank (RNG states and data-loader positions under per-rank keys, ``LocalShard`` lists,
   parts whose box no layout gives) is gathered to the coordinator only;
E. the coordinator builds the whole plan (the same :func:`zarrckpt.plan.save.plan_held` as
   ``build_save_plan``, on the same holders) and scatters each rank its ``zarr.json`` share, the
   arrays of its per-rank parts it writes, and for its class's tensors the writers of their joined
   and replicated shards (chosen over the whole save) and the numbers of their replicated blocks.
Every other rank derives the boxes of its class's tensors from the layouts and plans those tensors
(with their holders in other classes too) with the coordinator's writers (but per-rank arrays, held
by every rank: the coordinator sends each class their metadata, and a rank writes its row): for them, the plan
``build_save_plan`` gives from all descriptions, at a cost that grows with its class, not the job.
A :class:`~zarrckpt.PerRank` value is a layout too (rank ``r`` holds row ``r`` of ``[world, ...]``, the
same document on every rank), so per-rank state neither splits classes nor goes to the coordinator.
Where that could differ (a per-rank part of a key classes also hold, per-rank parts that are
replicated or joined as small shards) or there are over ``MAX_CLASSES`` classes, it answers None
and the caller gathers descriptions as before.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from zarrckpt import errors
from zarrckpt.errors import ZarrckptError
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.gcpause import gc_paused
from zarrckpt.format.keys import key_to_path
from zarrckpt.format.layout import Box, ChunkRule
from zarrckpt.plan.blocks import block_index, block_starts
from zarrckpt.plan.localstate import LocalState
from zarrckpt.plan.meshlayout import MeshLayout
from zarrckpt.plan.rankdesc import TensorSpec
from zarrckpt.plan.save import Held, ZarrSavePlan, metadata_shares, plan_held

MAX_CLASSES = 256
Check = Callable[[list[ArrayMeta]], None]  # a check of every array of the plan (object names), run by rank 0


def canon(obj: Any) -> str:
    """For comparing: keys sorted (equal JSON is equal, as ``build_save_plan`` compares values)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def wire(obj: Any) -> bytes:
    """For sending: key order kept (a value's, a topology's), as ``Group.all_gather_json`` sends it."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


@dataclass(frozen=True)
class Split:
    """One rank's description, split: DTensor layouts (rank-free) and everything else, as items."""

    layouts: dict[str, Any]  # key -> {"spec": spec JSON without its box, "mesh": MeshLayout JSON}
    plain: list[list[Any]]  # ["t", key, spec JSON] per other tensor part, ["v", key, value] per value

    def digest(self) -> bytes:
        return hashlib.sha256(canon(self.layouts).encode()).digest()[:16]

    def doc(self) -> bytes:
        return wire({"layouts": self.layouts, "plain": self.plain})


def split(local: LocalState, to_group: Callable[[int], int] = lambda r: r) -> Split:
    """``local``'s description as :class:`Split` (mesh ranks mapped to group ranks by ``to_group``)."""
    layouts: dict[str, Any] = {}
    plain: list[list[Any]] = []
    for key, parts in local.tensors.items():
        layout = parts[0].layout if len(parts) == 1 else None
        for part in parts:
            spec = part.spec().to_json()
            if layout is None:
                plain.append(["t", key, spec])
                continue
            del spec["box"]
            mesh = layout if part.per_rank else replace(layout, ranks=tuple(to_group(r) for r in layout.ranks))
            layouts[key] = {"spec": spec, "mesh": mesh.to_json()}
    plain += [["v", k, v] for k, v in local.values.items()]
    return Split(layouts, plain)


def classes_of(digests: list[bytes]) -> list[list[int]]:
    """The ranks of each distinct digest, classes in the order of their lowest rank."""
    found: dict[bytes, list[int]] = {}
    for rank, d in enumerate(digests):
        found.setdefault(d, []).append(rank)
    return list(found.values())


@dataclass
class ClassDoc:
    members: list[int]
    layouts: dict[str, Any]
    common: list[list[Any]]
    _held: dict[str, tuple[list[int], list[Any]]] = field(default_factory=dict)

    def keys(self, rows: bool = True) -> set[str]:
        """The tensor keys this class holds (``rows=False``: but per-rank arrays, which every rank
        holds a row of: the coordinator tells each rank its row's array)."""
        layouts = self.layouts if rows else {k for k, v in self.layouts.items() if not v["spec"].get("per_rank")}
        return set(layouts) | {key for kind, key, _ in self.common if kind == "t"}

    def held(self, only: set[str] | None = None) -> dict[str, tuple[list[int], list[Any]]]:
        """key -> (holder per part, parts) for this class's tensors and values (lists shared between
        keys of the same layout); with ``only``, for those tensor keys alone."""
        if only is not None:
            return ClassDoc(
                self.members,
                {k: v for k, v in self.layouts.items() if k in only},
                [item for item in self.common if item[0] == "t" and item[1] in only],
            ).held()
        if self._held:
            return self._held
        by_entry: dict[str, tuple[list[int], list[Any]]] = {}
        for key, entry in self.layouts.items():
            c = wire(entry).decode()
            if c not in by_entry:
                spec = TensorSpec.from_json({**entry["spec"], "box": [[], []]})
                boxes = MeshLayout.from_json(spec.shape, entry["mesh"]).boxes_of(self.members)
                by_entry[c] = (self.members, _with_boxes(spec, boxes))
            self._held[key] = by_entry[c]
        parts: dict[str, list[Any]] = {}
        specs: dict[str, TensorSpec] = {}  # equal items: one spec object (keys with equal holders share a grid)
        for kind, key, item in self.common:
            if kind == "t":
                c = wire(item).decode()
                item = specs[c] if c in specs else specs.setdefault(c, TensorSpec.from_json(item))
            parts.setdefault(kind + ":" + key, []).append(item)
        shared: dict[tuple[int, ...], tuple[list[int], list[Any]]] = {}
        for name, items in parts.items():
            kind, key = name.split(":", 1)
            if kind == "t":
                ids = tuple(map(id, items))
                if ids not in shared:
                    shared[ids] = self._every_member(items)
                self._held[key] = shared[ids]
            else:  # a value every member holds alike (the flags said so): its leader's copy stands for all
                self._held["v:" + key] = (self.members[:1], items)
        return self._held

    def _every_member(self, items: list[Any]) -> tuple[list[int], list[Any]]:
        """(holder per item, items) when every member holds ``items``."""
        if len(items) == 1:
            return list(self.members), items * len(self.members)
        return [m for m in self.members for _ in items], [x for _ in self.members for x in items]


def flags_of(mine: Split, leaders: list[list[list[Any]]], ci: int) -> np.ndarray:
    """This rank's flags for the MIN all-reduce (step C), one per item of every class leader's
    ``plain`` (``leaders``): 1 for other classes' items, :func:`my_flags` for its own class's (``ci``)."""
    at = [0]
    for items in leaders:
        at.append(at[-1] + len(items))
    flags = np.ones(at[-1], dtype=np.int64)
    flags[at[ci] : at[ci + 1]] = my_flags(mine, leaders[ci])
    return flags


def my_flags(mine: Split, leader: list[list[Any]]) -> np.ndarray:
    """1 per item of the leader's ``plain`` that this rank holds too; 0 for every item of a key of
    which this rank holds other parts as well (a key is common to a class whole or not at all)."""
    have = Counter(canon(item) for item in mine.plain)
    flags = np.zeros(len(leader), dtype=np.int64)
    for i, item in enumerate(leader):
        c = canon(item)
        if have[c] > 0:
            flags[i], have[c] = 1, have[c] - 1
    extra = {(item[0], item[1]) for item in mine.plain if have[canon(item)] > 0}
    flags[[i for i, item in enumerate(leader) if (item[0], item[1]) in extra]] = 0
    return flags


def own_items(mine: Split, doc: ClassDoc) -> list[list[Any]]:
    """This rank's items that are not its class's common items (they go to rank 0 only)."""
    common = {(item[0], item[1]) for item in doc.common}
    return [item for item in mine.plain if (item[0], item[1]) not in common]


def _with_boxes(spec: TensorSpec, boxes: list[Box]) -> list[TensorSpec]:
    """``spec`` with each of ``boxes`` (one object per distinct box)."""
    made: dict[Box, TensorSpec] = {}
    out = []
    for box in boxes:
        found = made.get(box)
        if found is None:
            found = made[box] = TensorSpec(
                spec.shape, spec.dtype, spec.kind, box, spec.topology, spec.python_type, spec.constant, spec.per_rank
            )
        out.append(found)
    return out


@gc_paused()
def class_docs(classes: list[list[int]], docs: list[bytes], flags: np.ndarray) -> list[ClassDoc]:
    """Each class's document with only the items all its members hold (``flags``: the MIN-reduced flags)."""
    out, at = [], 0
    for members, raw in zip(classes, docs, strict=True):
        doc = json.loads(raw)
        n = len(doc["plain"])
        partly = {(item[0], item[1]) for item, f in zip(doc["plain"], flags[at : at + n], strict=True) if f != 1}
        common = [item for item in doc["plain"] if (item[0], item[1]) not in partly]
        out.append(ClassDoc(members, doc["layouts"], common))
        at += n
    return out


def held_tables(
    docs: list[ClassDoc], privates: list[list[list[Any]]] | None, only: set[str] | None = None
) -> tuple[Held, Held]:
    """``(tensors, values)`` as :func:`plan_held` takes them, from the classes (and every rank's own
    items); with ``only``, of those tensor keys alone."""
    blocks: dict[str, list[tuple[list[int], list[Any]]]] = {}
    for doc in docs:
        for key, held in (doc.held() if only is None else doc.held(only & doc.keys())).items():
            blocks.setdefault(key, []).append(held)
    for rank, items in enumerate(privates or []):
        mine: dict[str, list[Any]] = {}
        for kind, key, item in items:
            mine.setdefault(key if kind == "t" else "v:" + key, []).append(
                TensorSpec.from_json(item) if kind == "t" else item
            )
        for name, got in mine.items():
            blocks.setdefault(name, []).append(([rank] * len(got), got))
    tensors: Held = {}
    values: Held = {}
    for name, parts in blocks.items():
        if len(parts) == 1:
            ranks, items = parts[0]
        else:
            merged = sorted(((r, i) for rs, xs in parts for r, i in zip(rs, xs, strict=True)), key=lambda p: p[0])
            ranks, items = [r for r, _ in merged], [i for _, i in merged]
        (values if name.startswith("v:") else tensors)[name.removeprefix("v:")] = (ranks, items)
    return tensors, values


@dataclass(frozen=True)
class Planned:
    """A rank's plan from :func:`zarrckpt.engine.saveplan.plan_compact`, with the save's replicated
    blocks: ``blocks`` of them in all, and the number of each this rank's plan holds (the replica
    check's vector)."""

    plan: ZarrSavePlan
    blocks: int
    block_index: dict[tuple[str, tuple[int, ...]], int]


@gc_paused()
def coordinate(
    docs: list[ClassDoc],
    privates: list[list[list[Any]]],
    world: int,
    chunk_bytes: int | ChunkRule,
    small_tensor_bytes: int,
    check: Check | None = None,
) -> tuple[Planned | None, list[bytes]]:
    """Rank 0: the whole plan (its arrays passed through ``check``), and each rank's payload: its
    class's writers of joined and replicated shards and replicated-block numbers, its zarr.json
    share and the arrays of its own items it writes; ``(None, fallback payloads)`` where the class
    plans could differ from it; an error payload for every rank where planning or ``check`` raised."""
    try:
        tensors, values = held_tables(docs, privates)
        plan = plan_held(tensors, values, world, chunk_bytes, small_tensor_bytes)
        if check is not None:
            check(list(plan.arrays.values()))
    except ZarrckptError as e:
        return None, [wire({"error": [type(e).__name__, str(e)]})] * world
    own = {key for items in privates for kind, key, _ in items if kind == "t"}
    class_keys = [doc.keys() for doc in docs]
    if own & set().union(*class_keys) or own & (set(plan.gathers) | plan.replicated):
        return None, [b'{"fallback":true}'] * world
    blocks, starts = block_starts(tensors, plan)
    rows = {k for k, meta in plan.arrays.items() if meta.per_rank}  # (a rank is told its rows, never plans them)
    chosen = plan.chosen_writers()
    of_class = [
        wire(
            {
                "writers": {k: chosen[k] for k in sorted(keys & chosen.keys())},
                "starts": {k: starts[k] for k in sorted(keys & starts.keys())},
                **({"rows": {k: plan.arrays[k].to_json() for k in sorted(keys & rows)}} if keys & rows else {}),
            }
        )
        for keys in class_keys
    ]
    class_of = {rank: i for i, doc in enumerate(docs) for rank in doc.members}
    shares = metadata_shares(list(plan.arrays.values()), world)
    arrays: list[dict[str, Any]] = [{} for _ in range(world)]
    owners: list[dict[str, list[list[int]]]] = [{} for _ in range(world)]
    for key in sorted(own & set(plan.arrays)):
        for idx, rank in plan.owners[key].items():
            arrays[rank][key] = plan.arrays[key].to_json()
            owners[rank].setdefault(key, []).append(list(idx))
    payloads = [
        b'{"blocks":%d,"class":%s,"rank":%s}'
        % (
            blocks,
            of_class[class_of[r]],
            wire({"docs": [[p, d.decode()] for p, d in shares[r]], "arrays": arrays[r], "owners": owners[r]}),
        )
        for r in range(world)
    ]
    return Planned(plan, blocks, block_index(tensors, plan, starts)), payloads


@gc_paused()
def local_plan(
    docs: list[ClassDoc], payload: bytes, rank: int, world: int, chunk_bytes: int | ChunkRule, small_tensor_bytes: int
) -> Planned | None:
    """A rank other than 0: the plan of the tensors its class holds (with every holder, also in other
    classes) and the writers the coordinator chose over the whole save, with the
    coordinator's ``payload`` merged in; None where it said to fall back. Raises the coordinator's
    error. Its cost does not depend on the number of classes, nor on the ranks outside its own."""
    got = json.loads(payload)
    if "error" in got:
        kind = getattr(errors, got["error"][0], None)
        raise (kind if isinstance(kind, type) and issubclass(kind, ZarrckptError) else ZarrckptError)(got["error"][1])
    if got.get("fallback"):
        return None
    mine = next(doc for doc in docs if rank in doc.members).keys(rows=False)
    tensors, _ = held_tables(docs, None, only=mine)
    plan = plan_held(tensors, {}, world, chunk_bytes, small_tensor_bytes, got["class"]["writers"])
    arrays = dict(plan.arrays)
    owners = dict(plan.owners)
    own = got["rank"]
    for key, doc in own["arrays"].items():
        arrays[key] = ArrayMeta.from_json(key_to_path(key), doc)
        owners[key] = {tuple(idx): rank for idx in own["owners"][key]}
    for key, doc in got["class"].get("rows", {}).items():  # per-rank arrays: this rank writes its row's shard
        meta = arrays[key] = ArrayMeta.from_json(key_to_path(key), doc)
        owners[key] = {} if meta.constant is not None else {(rank, *(0 for _ in meta.shape[1:])): rank}
    arrays, owners = dict(sorted(arrays.items())), dict(sorted(owners.items()))  # key order, as the whole plan's
    docs_ = tuple((p, d.encode()) for p, d in own["docs"])
    plan = replace(plan, arrays=arrays, owners=owners, docs=docs_, values={})
    return Planned(plan, got["blocks"], block_index(tensors, plan, got["class"]["starts"]))
