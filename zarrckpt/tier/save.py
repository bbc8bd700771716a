"""A local-tier save: the state in zarrckpt's own format in each node's tier directory, each node's
objects copied to ``replicas`` other nodes over the process group, then committed on every node.

The caller's thread plans and stages as :func:`zarrckpt.async_save` does (the same machinery,
:func:`zarrckpt.asyncsave.launch`, on threads and a gloo group of the tier's own, so a remote save
may run beside it). The writing thread then, with every rank:

1. agrees on the save id; each node's lowest rank deletes the node's steps beyond ``keep - 1`` and
   checks the room (``TierSpaceError`` before anything is written);
2. writes this rank's shards into the node's step directory, one durability barrier, then its
   held marker; rank 0 builds the manifest and checksum table from every rank's chunk record, and
   each node's lowest rank writes both (every node has them);
3. sends what it wrote to its replica ranks, which write the copies, flush, and write a held marker
   for each rank they hold;
4. once every rank got there (one collective), each node's lowest rank writes the committed
   marker. A step lacking it on every node, or lacking a held marker of some rank, is never restored.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from zarrckpt.asyncsave import AsyncSave, Exchange, Options, Staging, _Background, launch
from zarrckpt.display import Meter
from zarrckpt.engine.dist import Group
from zarrckpt.engine.exchange import gather_small
from zarrckpt.engine.writer import committed_manifest
from zarrckpt.format import integrity
from zarrckpt.format.layout import chunk_rule
from zarrckpt.format.manifest import MANIFEST
from zarrckpt.plan.save import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES, ZarrSavePlan
from zarrckpt.staging import Handoff, write_staged
from zarrckpt.storage.store import Storage
from zarrckpt.tier import LocalTier, nodedir
from zarrckpt.tier.layout import FORMAT, Nodes, step_dir
from zarrckpt.tier.ship import ship

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger("zarrckpt")
_background = _Background()  # the tier's own writer and stager threads (a remote save runs beside)
SIDE = "tier"  # its own gloo group, too
ROOM_SLACK = 1.02  # shard indexes and the manifest, over the data bytes


def save_local(
    tier: LocalTier,
    nodes: Nodes,
    state_dict: Mapping[str, Any],
    step: int,
    *,
    process_group: ProcessGroup | None = None,
    staging: Staging = "caller",
    staging_budget_bytes: int | None = None,
    first: bool = False,
) -> AsyncSave:
    """Start a local-tier save of ``step``; every rank calls it, with the job's ``nodes``. Returns as
    :func:`zarrckpt.async_save` does (after staging, or with ``staging="background"`` after planning);
    the future completes once the step is committed on every node, or carries the error (nothing of
    it is then ever restored). ``first``: before returning, check that ``keep`` steps of this size
    fit in every node's tier (``TierSpaceError`` on every rank, nothing written)."""
    root = tier.root()
    os.makedirs(root, exist_ok=True)
    storage = Storage(root)  # (the names check and the progress meter; the job writes in the step's directory)

    def job(plan: ZarrSavePlan, group: Group, handoff: Handoff, bar: Meter, exchange: Exchange | None) -> _TierJob:
        made = _TierJob(tier, nodes, root, step, plan, group, handoff, exchange)
        if first:  # (no tier job runs now: launch waited for the last one)
            sizes = [int(n) for n in group.all_gather_json(plan.bytes_of(group.rank))]
            group.run_together(partial(made.capacity, sizes), "checking the local tier's room")
        return made

    rule = chunk_rule(DEFAULT_CHUNK_BYTES, "rows")
    options = Options(rule, True, DEFAULT_SMALL_TENSOR_BYTES, False, staging, staging_budget_bytes, False)
    return launch(_background, state_dict, storage, job, options, process_group=process_group, side=SIDE)


@dataclass
class _TierJob:
    tier: LocalTier
    nodes: Nodes
    root: str
    step: int
    plan: ZarrSavePlan
    group: Group
    handoff: Handoff
    exchange: Exchange | None
    written: integrity.Written = field(default_factory=dict)

    def run(self) -> None:
        try:
            self._run()
        except BaseException:
            self.handoff.abandon()
            raise

    def _run(self) -> None:
        group, rank = self.group, self.group.rank
        if self.exchange is not None:
            local, done = self.exchange
            try:
                gather_small(group, self.plan, local)
            finally:
                done.set()
        nodes = self.nodes
        committed_here = [s.save_id for s in nodedir.scan(self.root) if s.committed] if nodes.lead(rank) else []
        gathered = group.all_gather_json([self.plan.bytes_of(rank), committed_here])
        sizes = [int(n) for n, _ in gathered]
        committed = {sid for _, sids in gathered for sid in sids}  # (a step some node saw committed)
        begun = group.run_together(partial(self._begin, sizes, committed), "preparing the local tier", share=True)
        assert begun is not None  # (rank 0's, on every rank)
        sid, started = str(begun[0]), float(begun[1])
        step_root = os.path.join(self.root, step_dir(self.step, sid))
        os.makedirs(step_root, exist_ok=True)
        doc = {"format": FORMAT, "save_id": sid, "step": self.step, "world_size": group.size, "started": started}
        storage = Storage(step_root)
        group.run_together(partial(self._write, storage, step_root, doc), "writing shards to the local tier")
        record = integrity.to_json(self.written)
        views = [record] if group.size == 1 else group.gather_json(record)
        manifest = committed_manifest(sid, self.plan.arrays, self.plan.values, group.size, views) if rank == 0 else None
        raw = group.broadcast_bytes(manifest.dumps() if manifest is not None else b"")
        table = group.broadcast_bytes(manifest.table if manifest is not None else b"")
        group.run_together(partial(self._manifest, nodes, storage, raw, table), "writing the local manifest")
        mine = self._paths()
        targets = nodes.replica_ranks(rank, self.tier.replicas)
        sources = nodes.replica_sources(rank, self.tier.replicas)

        def land(path: str, data: memoryview) -> None:  # a copy: made durable with the others by one barrier
            storage.create(path, [data], durable=False)

        size, read = partial(nodedir.size, step_root), partial(nodedir.read_into, step_root)
        ship(group, {dst: mine for dst in targets}, sources, size, read, land)
        group.run_together(partial(self._replicas, storage, step_root, sources, doc), "writing replica copies")
        group.run_together(
            lambda: nodedir.committed(step_root, {**doc, "nodes": nodes.to_json()}) if nodes.lead(rank) else None,
            "committing the local step",
        )
        log.info("local step %d committed in %s (%d objects of this rank)", self.step, step_root, len(mine))

    def _begin(self, sizes: list[int], committed: set[str]) -> list[Any] | None:
        """Each node's lowest rank: delete the node's steps beyond ``keep - 1`` (``committed``: save ids
        some node saw committed), check the room for this one."""
        if self.nodes.lead(self.group.rank):
            nodedir.prune(self.root, self.tier.keep - 1, committed)
            nodedir.check_room(self.root, self._node_bytes(sizes), 0, self.tier, self.nodes.names)
        return [uuid.uuid4().hex, time.time()] if self.group.rank == 0 else None

    def capacity(self, sizes: list[int]) -> None:
        """Each node's lowest rank: the ``keep`` newest steps fit in the tier once this one is written (its
        free room, and what the next pruning deletes; the steps kept count as of this size)."""
        if self.nodes.lead(self.group.rank):
            need = self._node_bytes(sizes) * self.tier.keep
            kept = [s for s in nodedir.scan(self.root) if s.committed][: self.tier.keep - 1]
            need -= sum(nodedir.usage(self.root, [step_dir(s.step, s.save_id)]) for s in kept)
            reclaimable = nodedir.usage(self.root, nodedir.doomed(self.root, self.tier.keep - 1))
            nodedir.check_room(self.root, need, reclaimable, self.tier, self.nodes.names)

    def _node_bytes(self, sizes: list[int]) -> int:
        """What a step takes in this node's tier: its ranks' shards and the copies it holds for others."""
        here = self.nodes.ranks[self.nodes.index(self.group.rank)]
        holders = {r for r0 in here for r in [r0, *self.nodes.replica_sources(r0, self.tier.replicas)]}
        return int(sum(sizes[r] for r in holders) * ROOM_SLACK) + 2**20

    def _write(self, storage: Storage, step_root: str, doc: dict[str, Any]) -> None:
        write_staged(storage, self.plan, self.handoff, self.group.rank, self.written)
        storage.flush()
        nodedir.held(step_root, self.group.rank, doc)

    def _manifest(self, nodes: Nodes, storage: Storage, raw: bytes, table: bytes) -> None:
        if nodes.lead(self.group.rank):
            storage.create(integrity.TABLE, [table])  # (empty when every array is constant)
            storage.create(MANIFEST, [raw])

    def _replicas(self, storage: Storage, step_root: str, sources: list[int], doc: dict[str, Any]) -> None:
        storage.flush()  # the copies on disk before their markers
        for src in sources:
            nodedir.held(step_root, src, doc)

    def _paths(self) -> list[str]:
        """The objects this rank wrote (its shards)."""
        rank, written = self.group.rank, self.written
        return [
            meta.shard_path(idx)
            for meta, idx in self.plan.shards_of(rank)
            if integrity.shard_number(meta, idx) in written.get(meta.key, {})
        ]
