"""Write this rank's shards (and the array metadata it is responsible for) for a save plan."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from zarrckpt.engine import commit as protocol
from zarrckpt.engine import markers
from zarrckpt.engine.dist import Group
from zarrckpt.errors import CheckpointExistsError, ZarrckptError
from zarrckpt.format import dtypes, integrity
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.layout import Shape, cell_box
from zarrckpt.format.manifest import Manifest, library_name
from zarrckpt.format.shard import chunk_crcs, chunks_per_shard, encode_shard
from zarrckpt.plan.localstate import LocalState, LocalTensor
from zarrckpt.plan.save import ZarrSavePlan
from zarrckpt.storage.store import Storage

log = logging.getLogger("zarrckpt")


def write_rank(
    storage: Storage,
    plan: ZarrSavePlan,
    local: LocalState,
    rank: int,
    written: integrity.Written | None = None,
    *,
    shards: Sequence[tuple[ArrayMeta, Shape]] | None = None,
    held_only: bool = False,
) -> int:
    """Write the shards ``rank`` owns (``shards``: only these of them); returns the bytes written.

    Each shard is cut from the part of ``local`` that holds it; a shard no part holds is an error,
    unless ``held_only`` (``local`` holds some of the rank's parts: write just their shards).
    Objects are written concurrently, create-only; ``written`` receives every written shard's
    chunk checksums (for the manifest's record). The ``zarr.json`` documents come later
    (:func:`write_metadata`), once every rank's shards exist.
    """
    record: integrity.Written = {} if written is None else written  # filled from the writing threads
    start = time.perf_counter()
    host: dict[int, Any] = {}  # id(part) -> numpy view of it, on the host
    jobs = []
    for meta, idx in plan.shards_of(rank) if shards is None else shards:
        held = local.tensors.get(meta.key, ())
        part: LocalTensor | None
        if len(held) == 1 and meta.shard_shape == meta.shape == held[0].box.sizes:  # the one part is the one shard
            part, cell = held[0], None
        else:
            cell = cell_box(idx, meta.shard_shape, meta.shape)
            part = local.part_holding(meta.key, cell)
        if part is None:
            if held_only:
                continue
            raise ZarrckptError(
                f"{meta.key}: this rank (rank {rank}) was to write shard {cell} but holds no part with it"
            )
        view = host.get(id(part))
        if view is None:  # stage on the host first (GPU -> CPU copies stay on this thread)
            view = host[id(part)] = dtypes.as_numpy(part.data.detach().cpu())
        if cell is not None and cell != part.box:
            view = view[cell.relative_to(part.box.offsets).slices()]
        jobs.append((meta, idx, view))

    def write_shard(job: tuple[ArrayMeta, Shape, Any]) -> int:
        meta, idx, data = job
        shard, chunk = meta.shard_shape, meta.chunk_shape
        parts = encode_shard(data, shard, chunk)
        crcs = chunk_crcs(parts, 1 if shard == chunk else math.prod(chunks_per_shard(shard, chunk)))
        nbytes = _put(storage, meta.shard_path(idx), parts)
        number = 0 if shard == meta.shape else integrity.shard_number(meta, idx)  # (one shard: number 0)
        record.setdefault(meta.key, {})[number] = crcs  # one key per shard: thread-safe
        return nbytes

    nbytes = storage.write_all(write_shard, jobs, size=lambda job: job[2].nbytes)
    log.info("rank %d wrote %d shards, %.1f MB in %.2fs", rank, len(jobs), nbytes / 1e6, time.perf_counter() - start)
    return nbytes


def write_metadata(storage: Storage, docs: list[tuple[str, bytes]]) -> int:
    """Write group and array ``zarr.json`` documents (``plan.metadata_docs``): after every rank's
    shards, so a generic Zarr reader never finds an array whose chunks are still missing. Then the
    durability barrier: every object this ``storage`` wrote (shards and documents) is on disk before
    this returns, so before the commit (:meth:`~zarrckpt.storage.store.Storage.flush`)."""
    nbytes = storage.write_all(lambda doc: _put(storage, doc[0], [doc[1]]), docs, size=lambda doc: len(doc[1]))
    storage.flush()
    return nbytes


def commit_save(storage: Storage, group: Group, plan: ZarrSavePlan, save_id: str, written: integrity.Written) -> None:
    """After every rank wrote its shards: the ``zarr.json`` documents, then rank 0 commits the
    manifest with the record of every chunk written (gathered from all ranks, one collective)."""
    views = [written] if group.size == 1 else group.gather_json(integrity.to_json(written))  # (one process: as it is)
    group.run_together(lambda: write_metadata(storage, plan.metadata_of(group.rank)), "writing metadata")

    def commit() -> None:
        if group.rank == 0:
            protocol.commit(storage, committed_manifest(save_id, plan.arrays, plan.values, plan.world_size, views))

    group.run_together(commit, "committing")


def committed_manifest(
    save_id: str,
    arrays: Mapping[str, ArrayMeta],
    values: Mapping[str, Any],
    world_size: int,
    written: Sequence[Mapping[str, Mapping[str, str]] | integrity.Written],
    *,
    library: str | None = None,
    dcp: dict[str, Any] | None = None,
) -> Manifest:
    """The manifest a commit writes (every save path builds it here): arrays and values in key
    order, the commit time, the writing library, and the record of every chunk ``written`` (each
    writer's :func:`zarrckpt.format.integrity.to_json`, or one process's record as it is), its
    chunk checksum table with it; raises when some shard was written by no one."""
    records, table = integrity.records(arrays, written)
    return Manifest(
        save_id,
        dict(sorted(arrays.items())),
        dict(sorted(values.items())),
        world_size,
        markers.now(),
        library or library_name(),
        dcp or {},
        records,
        integrity.table_ref(table),
        table,
    )


def _put(storage: Storage, path: str, parts: list[bytes] | list[Any]) -> int:
    """Create one object (after the storage's ``guard``: the save still holds the location,
    :class:`~zarrckpt.engine.markers.Ownership`), durable only after the barrier in
    :func:`write_metadata`; another writer's object already there means this save lost a race."""
    try:
        storage.write(path, parts, create_only=storage.atomic_create, durable=False)
    except FileExistsError:
        raise CheckpointExistsError(
            f"another save is writing to {storage.url!r}: {path} was created by another writer; "
            "this save is abandoned uncommitted"
        ) from None
    return sum(len(p) for p in parts)
