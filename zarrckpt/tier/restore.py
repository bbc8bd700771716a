"""Restore the newest local step that survives, under any world size or layout.

Every rank calls :func:`restore`. Each node's lowest rank says what its tier directory holds (one
all-gather); :func:`zarrckpt.tier.layout.choose` picks, alike on every rank, the newest step that
some node saw committed and whose every saving rank's objects survive on some node. The manifest
and checksum table come from a node holding the step (one broadcast each). The load is planned as
any load (:func:`zarrckpt.api.load_from`). Each rank reads what its node's tier holds of the step
where it is; of the other objects, a rank of a node holding them sends it the byte ranges its reads
fetch, into memory (:mod:`zarrckpt.tier.received`). Every chunk is checked against the step's commit
record, wherever it came from.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import MutableMapping, Sequence
from functools import partial
from typing import Any

from zarrckpt.api import load_from
from zarrckpt.engine import crctable, loader
from zarrckpt.engine.dist import Group
from zarrckpt.errors import IncompleteCheckpointError
from zarrckpt.format import integrity
from zarrckpt.format.manifest import MANIFEST, Manifest
from zarrckpt.plan.fetch import Request, plan_reads, plan_shard
from zarrckpt.storage.caps import LOCAL_FILES
from zarrckpt.storage.store import Storage
from zarrckpt.tier import LocalTier, nodedir
from zarrckpt.tier.layout import Choice, Nodes, StepSeen, choose, senders, step_dir
from zarrckpt.tier.received import with_received
from zarrckpt.tier.ship import ship

log = logging.getLogger("zarrckpt")


def survey(tier: LocalTier, group: Group, nodes: Nodes, newer_than: int | None) -> Choice | None:
    """The newest local step the restoring job (on ``nodes``) can assemble that is at least as new as
    ``newer_than`` (None: none); every rank calls it and gets the same answer (one all-gather)."""
    mine = [s.to_json() for s in nodedir.scan(tier.root())] if nodes.lead(group.rank) else None
    views = group.all_gather_json(mine)
    seen = {
        name: [StepSeen.from_json(d) for d in views[ranks[0]]]
        for name, ranks in zip(nodes.names, nodes.ranks, strict=True)
    }
    return choose(seen, newer_than)


def restore(
    tier: LocalTier, group: Group, nodes: Nodes, choice: Choice, state_dict: MutableMapping[str, Any], **kwargs: Any
) -> dict[str, int]:
    """Load local step ``choice`` into ``state_dict`` (as :func:`zarrckpt.load` takes ``kwargs``).

    Raises:
        IncompleteCheckpointError: an object the load needs is on no surviving node after all.
        CorruptChunkError, ZarrckptError: as a load raises them (on every rank).
    """
    start = time.perf_counter()
    root = tier.root()
    step_root = os.path.join(root, step_dir(choice.step, choice.save_id))
    source = nodes.ranks[nodes.names.index(choice.holders[0])][0]  # the lowest rank of a node holding the step
    where = f"local step {choice.step} ({step_root} on node {choice.holders[0]})"

    raw, table = _from_source(group, source, step_root, where)
    manifest = crctable.with_table(Manifest.loads(raw, where), lambda: table, 1, where)
    read = partial(_read, group, nodes, step_root)
    stats = load_from(state_dict, group, Storage(step_root), manifest, read, **kwargs)
    log.info("restored local step %d in %.2fs", choice.step, time.perf_counter() - start)
    return stats


def _from_source(group: Group, source: int, step_root: str, where: str) -> tuple[bytes, bytes]:
    """The step's manifest and checksum table as ``source`` reads them, on every rank (one broadcast;
    a failure to read them raised on every rank)."""
    sent = b""
    if group.rank == source:
        try:
            parts = []
            for name in (MANIFEST, integrity.TABLE):
                with open(os.path.join(step_root, name), "rb") as f:
                    parts.append(f.read())
            sent = b"\0" + len(parts[0]).to_bytes(8, "little") + parts[0] + parts[1]
        except OSError as e:
            sent = b"\1" + f"{where}: cannot read its manifest or checksum table: {e}".encode()
    got = group.broadcast_from(source, sent)
    if got[:1] != b"\0":
        raise IncompleteCheckpointError(got[1:].decode())
    n = int.from_bytes(got[1:9], "little")
    return got[9 : 9 + n], got[9 + n :]


def _read(
    group: Group,
    nodes: Nodes,
    step_root: str,
    manifest: Manifest,
    requests: Sequence[Request],
    *,
    on_received: Any = None,
) -> int:
    """Gather the byte ranges ``requests`` read of the objects this rank's node lacks (received into
    memory from a node that holds them), then read them and the node's own objects from ``step_root``."""
    stored = [r for r in requests if r.meta.constant is None]
    reads = [plan_shard(task, LOCAL_FILES) for task in plan_reads(stored)]  # what loader.read fetches below
    lacking = {r.task.path for r in reads if not os.path.isfile(os.path.join(step_root, r.task.path))}
    mine = [
        _range(r.task.path, f.start, f.start + f.nbytes(r.layout))
        for r in reads
        if r.task.path in lacking
        for f in r.fetches
    ]
    wanted = group.all_gather_json(mine)
    union = sorted({_unrange(item)[0] for w in wanted for item in w})
    lead = nodes.lead(group.rank)
    have = [i for i, p in enumerate(union) if os.path.exists(os.path.join(step_root, p))] if lead and union else []
    haves = group.all_gather_json(have)
    held_by: list[list[int]] = [[] for _ in union]
    for node, ranks in enumerate(nodes.ranks):
        for i in haves[ranks[0]]:
            held_by[i].append(node)
    sender, lost = senders(union, held_by, nodes)
    if lost:
        raise IncompleteCheckpointError(
            f"restoring from the local tier: {len(lost)} objects are on no surviving node (first: {lost[0]}), "
            "although every rank's held marker survives; the tier was changed after it was committed"
        )
    sends: dict[int, list[str]] = {}
    for rank, items in enumerate(wanted):  # each rank receives the ranges it reads of what its node lacks
        for item in items:
            if sender[_unrange(item)[0]] == group.rank:
                sends.setdefault(rank, []).append(item)
    sources = sorted({sender[_unrange(item)[0]] for item in wanted[group.rank]})
    pieces: dict[str, list[tuple[int, memoryview]]] = {}

    def size(item: str) -> int:
        _, start, end = _unrange(item)
        return end - start

    def read(item: str, view: memoryview) -> None:
        path, start, _ = _unrange(item)
        nodedir.read_into(step_root, path, view, start)

    def land(item: str, view: memoryview) -> None:
        path, start, _ = _unrange(item)
        pieces.setdefault(path, []).append((start, view))

    received = ship(group, sends, sources, size, read, land)
    if on_received is not None and received:
        on_received(received)
    storage = with_received(step_root, pieces)
    return (
        loader.read(group, storage, manifest, requests, fan_out=False, allow_modified=False, planned=reads) + received
    )


def _range(path: str, start: int, end: int) -> str:
    """A byte range of an object, as shipped: ``<start>:<end>:<path>``."""
    return f"{start}:{end}:{path}"


def _unrange(item: str) -> tuple[str, int, int]:
    start, end, path = item.split(":", 2)
    return path, int(start), int(end)
