"""A save's planning over the process group: the collectives that make every rank's plan, the
replica check and the small-part exchange.

The layout math is :mod:`zarrckpt.plan.save` and :mod:`zarrckpt.plan.compact` (pure: bytes and
objects in, plans out); ``zarrckpt.save`` runs this, then :mod:`zarrckpt.engine.writer`, as
``zarrckpt.load`` runs :mod:`zarrckpt.plan.targets` and :mod:`zarrckpt.engine.loader`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Protocol

import numpy as np

from zarrckpt.engine import replicas
from zarrckpt.engine.dist import Group
from zarrckpt.engine.exchange import gather_small
from zarrckpt.errors import SaveLayoutError
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.layout import ChunkRule
from zarrckpt.plan import compact
from zarrckpt.plan.blocks import replica_vector
from zarrckpt.plan.localstate import LocalState
from zarrckpt.plan.rankdesc import RankDescription
from zarrckpt.plan.save import ZarrSavePlan, build_save_plan


def plan_save(
    group: Group,
    local: LocalState,
    chunk_bytes: int | ChunkRule,
    check_replicas: bool,
    small_tensor_bytes: int,
    *,
    exchange: bool = True,
    check: Callable[[list[ArrayMeta]], None] | None = None,
    force_gather: bool = False,
) -> ZarrSavePlan:
    """Every rank: its plan from the ranks' layouts (:func:`plan_compact`: a digest all-gather, one
    broadcast per class of ranks, one MIN all-reduce, a gather to and a scatter from rank 0; bytes
    per rank that do not grow with the job), or, where that cannot be used (or ``force_gather``:
    tests, the planner before issue 28), from all ranks' gathered descriptions; the same plan
    either way. Then check that replicated blocks hold the same bytes (a MIN all-reduce of their
    digests, only when some are replicated), and hand each small tensor's writer the parts it lacks
    (one exchange, only when there are such; not with ``exchange=False``: the caller runs
    :func:`zarrckpt.engine.exchange.gather_small` itself).

    ``check`` (the object-name check) sees every array of the plan before anything else: on rank 0,
    whose error every rank raises, or on every rank where each has the whole plan."""
    pad_rows(group, local)
    planned = None
    if group.active and not force_gather:
        planned = plan_compact(group, local, chunk_bytes, small_tensor_bytes, group.to_group_rank, check)
    if planned is None:
        if group.size == 1:  # (one process: its description as it is, not through JSON)
            descriptions = [local.describe()]
        else:
            views = group.all_gather_json(local.describe().to_json())
            descriptions = [RankDescription.from_json(v) for v in views]
        plan = build_save_plan(descriptions, chunk_bytes, small_tensor_bytes)
        if check is not None:
            check(list(plan.arrays.values()))
        if check_replicas:
            replicas.check(group, plan, local)
    else:
        plan, n = planned.plan, planned.blocks
        if check_replicas and n:  # the save's count: a rank holding none of them takes part too
            low = group.all_reduce_min(replica_vector(n, planned.block_index, replicas.digests(plan, local)))
            if (low[:n] != -low[n:]).any():
                replicas.report(group, plan, local)  # the replicas differ: gather their digests for the message
    if exchange:
        gather_small(group, plan, local)
    return plan


def pad_rows(group: Group, local: LocalState) -> None:
    """Pad every rank's ``json`` rows of :class:`~zarrckpt.PerRank` values to the longest (a MIN
    all-reduce of the ranks' counts of them, then, when there are any, one of their lengths)."""
    lengths = local.json_rows()
    if group.active:
        n = len(lengths)
        low = group.all_reduce_min(np.array([n, -n], dtype=np.int64))
        if low[0] != -low[1]:
            mine = ", ".join(list(lengths)[:5]) or "none"
            raise SaveLayoutError(
                f"nothing was written: ranks hold {low[0]} to {-low[1]} PerRank values that are not tensors "
                f"(this rank, {group.rank}, holds {n}: {mine}); every rank must hold each PerRank key"
            )
        if n:
            longest = -group.all_reduce_min(-np.array(list(lengths.values()), dtype=np.int64))
            lengths = dict(zip(lengths, (int(x) for x in longest), strict=True))
    local.pad_rows(lengths)


class Collectives(Protocol):
    """What :func:`plan_compact` needs of a process group (:class:`zarrckpt.engine.dist.Group`)."""

    rank: int
    size: int

    def all_gather_fixed(self, data: bytes) -> list[bytes]: ...  # every rank's equal-length ``data``
    def broadcast_from(self, root: int, data: bytes) -> bytes: ...  # ``root``'s data
    def all_reduce_min(self, values: np.ndarray) -> np.ndarray: ...  # int64, elementwise
    def gather_to0(self, data: bytes) -> list[bytes]: ...  # every rank's data on rank 0, [] elsewhere
    def scatter_from0(self, parts: list[bytes]) -> bytes: ...  # rank 0's parts[r] on rank r


def plan_compact(
    coll: Collectives,
    local: LocalState,
    chunk_bytes: int | ChunkRule,
    small_tensor_bytes: int,
    to_group: Callable[[int], int] = lambda r: r,
    check: compact.Check | None = None,
) -> compact.Planned | None:
    """This rank's plan by the protocol of :mod:`zarrckpt.plan.compact` (collective; steps A to E
    there); None: plan by gathering every description instead (every rank alike)."""
    mine = compact.split(local, to_group)
    classes = compact.classes_of(coll.all_gather_fixed(mine.digest()))  # A
    if len(classes) > compact.MAX_CLASSES:
        return None
    docs = [coll.broadcast_from(m[0], mine.doc() if coll.rank == m[0] else b"") for m in classes]  # B
    leaders = [json.loads(d)["plain"] for d in docs]
    ci = next(i for i, m in enumerate(classes) if coll.rank in m)
    cdocs = compact.class_docs(classes, docs, coll.all_reduce_min(compact.flags_of(mine, leaders, ci)))  # C
    privates = [json.loads(raw) for raw in coll.gather_to0(compact.wire(compact.own_items(mine, cdocs[ci])))]  # D
    if coll.rank == 0:  # E
        planned, payloads = compact.coordinate(cdocs, privates, coll.size, chunk_bytes, small_tensor_bytes, check)
        coll.scatter_from0(payloads)
        if planned is None:  # raises the error, or answers None (fall back), as on the other ranks
            compact.local_plan(cdocs, payloads[0], 0, coll.size, chunk_bytes, small_tensor_bytes)
        return planned
    return compact.local_plan(cdocs, coll.scatter_from0([]), coll.rank, coll.size, chunk_bytes, small_tensor_bytes)
