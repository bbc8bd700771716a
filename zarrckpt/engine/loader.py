"""A load's I/O: the manifest read once per job, the reads (fanned out or not), the end-of-load check.

The keys, targets and requests are planned by :mod:`zarrckpt.plan.targets`; ``zarrckpt.load``
runs the two in turn, as ``zarrckpt.save`` runs :mod:`zarrckpt.engine.saveplan` (over
:mod:`zarrckpt.plan.save`) and :mod:`zarrckpt.engine.writer`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from zarrckpt.engine import commit as protocol
from zarrckpt.engine import crctable
from zarrckpt.engine.dist import Group
from zarrckpt.engine.fanread import read_shared
from zarrckpt.engine.reader import read_regions
from zarrckpt.errors import InvalidCheckpointError, ZarrckptError
from zarrckpt.format import integrity
from zarrckpt.format.manifest import MANIFEST, Manifest
from zarrckpt.plan import targets
from zarrckpt.plan.fetch import Request, ShardRead
from zarrckpt.storage.store import Storage


def open_manifest(group: Group, storage: Storage, *, allow_modified: bool) -> Manifest:
    """The checkpoint's manifest on every rank: rank 0 reads it (one GET per job, whatever the world
    size), every rank parses the same bytes; bytes that fail their checks (not JSON, a digest that does
    not match) are read again first, as :func:`~zarrckpt.engine.commit.read_manifest` does.
    ``allow_modified``: without its commit record.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, InvalidCheckpointError, StorageError: on
            every rank, as rank 0 met it.
    """
    raw = group.on_rank0(lambda: protocol.read_manifest_bytes(storage), "opening the checkpoint")
    where, attempts = storage.where(MANIFEST), storage.retry.attempts
    for attempt in range(1, attempts + 1):  # (the same bytes on every rank: every rank decides alike)
        try:
            manifest = group.run_together(partial(Manifest.loads, raw, where), "opening the checkpoint")
        except InvalidCheckpointError:
            if attempt == attempts or not raw.isascii() or (again := _reread(group, storage)) == raw:
                raise
        else:
            if not manifest.modified or attempt == attempts or (again := _reread(group, storage)) == raw:
                break
        storage.traffic.add(retries=1)  # it failed its checks, and the bytes read again differ: damaged on the way
        raw = again
    if allow_modified:
        return manifest.as_is()
    # the chunk checksum table: rank 0 reads it (one GET per job), every rank takes its arrays' segments
    table = partial(group.on_rank0, partial(crctable.read_table, storage), "reading the chunk checksums")
    return crctable.with_table(manifest, table, attempts, storage.where(integrity.TABLE))


def _reread(group: Group, storage: Storage) -> bytes:
    return group.on_rank0(lambda: protocol.read_manifest_bytes(storage), "opening the checkpoint")


def agree(
    group: Group, matched: targets.Match, manifest: Manifest, *, keys: Sequence[str] | None, strict: bool, url: str
) -> targets.Agreement:
    """What the load reads, decided alike on every rank (:func:`zarrckpt.plan.targets.agree`; raises
    its ``LayoutMismatchError`` on every rank).

    Which saved keys some rank asks for travels as one MIN all-reduce of a flag per saved key, so
    a rank receives O(keys) bytes whatever the world size (every rank's key list, the plain way,
    is ~2.4 GB per rank at 8,192 ranks asking for 6,000 keys each); the keys asked for that are
    not saved and the differences (usually none, the same on every rank) go as digests plus each
    distinct list once (:meth:`~zarrckpt.engine.dist.Group.all_gather_alike_json`).
    """
    saved = targets.saved_keys(manifest)
    requested = matched.requested()
    nobody = np.fromiter((k not in requested for k in saved), dtype=np.int64, count=len(saved))
    if len(saved):
        nobody = group.all_reduce_min(nobody)
    asked = {k for k, none in zip(saved, nobody.tolist(), strict=True) if not none}
    views = group.all_gather_alike_json(matched.view(set(saved)))
    return targets.agree(asked, views, matched, manifest, keys=keys, strict=strict, url=url)


def read(
    group: Group,
    storage: Storage,
    manifest: Manifest,
    requests: Sequence[Request],
    *,
    fan_out: bool,
    allow_modified: bool,
    on_received: Callable[[int], None] | None = None,
    planned: Sequence[ShardRead] | None = None,
) -> int:
    """Fill every request (every rank calls it); returns the bytes this rank fetched.

    ``fan_out``: regions several ranks need are read once and sent over the process group
    (:mod:`zarrckpt.engine.fanread`; ``on_received`` is told the bytes of what arrived). A load that
    returns holds the committed data of ``manifest``: every chunk used is compared with the commit
    record, or, where that cannot tell (``allow_modified``, no record), rank 0 checks at the end that
    the manifest is still this save's. ``planned``: the reads, as :func:`read_regions` would plan them.

    Raises:
        IncompleteCheckpointError: the checkpoint was overwritten or deleted meanwhile (what a read
            failure is then put down to).
        CorruptChunkError, ModifiedCheckpointError, StorageError, ZarrckptError: a read failed (on
            another rank: named in the message).
    """
    try:
        if fan_out:
            nbytes = read_shared(group, storage, manifest, requests, any_layout=allow_modified, on_received=on_received)
        else:
            read = partial(read_regions, storage, requests, any_layout=allow_modified, planned=planned)
            nbytes = group.run_together(read, "reading")
    except ZarrckptError:
        _check_unchanged(group, storage, manifest.save_id)  # an overwrite explains it better
        raise
    if not integrity.reads_are_checked(list(manifest.arrays.values()), allow_modified):
        _check_unchanged(group, storage, manifest.save_id)  # else every chunk used was the committed one
    return nbytes


def _check_unchanged(group: Group, storage: Storage, save_id: str) -> None:
    """The end-of-load check (the manifest is still this save's), by rank 0 for every rank."""

    def check() -> bytes:
        protocol.check_unchanged(storage, save_id)
        return b""

    group.on_rank0(check, "checking that the checkpoint is unchanged")
