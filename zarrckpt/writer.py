"""Write this rank's shards (and the array metadata it is responsible for) for a save plan."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from . import commit as protocol
from . import dtypes, integrity
from .dist import Group
from .errors import CheckpointExistsError
from .format import ArrayMeta, Manifest, library_name
from .layout import Shape, cell_box
from .localstate import LocalState
from .plan import ZarrSavePlan
from .shard import chunk_crcs, chunks_per_shard, encode_shard
from .storage import Storage

log = logging.getLogger("zarrckpt")


def write_rank(
    storage: Storage,
    plan: ZarrSavePlan,
    local: LocalState,
    rank: int,
    keys: Collection[str] | None = None,
    written: integrity.Written | None = None,
) -> int:
    """Write the shards ``rank`` owns (of ``keys`` only, when given); returns the bytes written.

    Objects are written concurrently, create-only; ``written`` receives every written shard's
    chunk checksums (for the manifest's record). The ``zarr.json`` documents come later
    (:func:`write_metadata`), once every rank's shards exist.
    """
    record: integrity.Written = {} if written is None else written  # filled from the writing threads
    start = time.perf_counter()
    host: dict[str, Any] = {}  # key -> numpy view of the local part, on the host
    shards = [(m, idx) for m, idx in plan.shards_of(rank) if keys is None or m.key in keys]
    for meta, _ in shards:  # stage on the host first (GPU -> CPU copies stay on this thread)
        if meta.key not in host:
            host[meta.key] = dtypes.as_numpy(local.tensors[meta.key].data.detach().cpu())

    def write_shard(job: tuple[ArrayMeta, Shape]) -> int:
        meta, idx = job
        cell = cell_box(idx, meta.shard_shape, meta.shape)
        data = host[meta.key][cell.relative_to(local.tensors[meta.key].box.offsets).slices()]
        parts = encode_shard(data, meta.shard_shape, meta.chunk_shape)
        crcs = chunk_crcs(parts, math.prod(chunks_per_shard(meta.shard_shape, meta.chunk_shape)))
        nbytes = _put(storage, meta.shard_path(idx), parts)
        record.setdefault(meta.key, {})[integrity.shard_number(meta, idx)] = crcs  # one key per shard: thread-safe
        return nbytes

    nbytes = sum(storage.run_all(write_shard, shards, writing=True))
    log.info("rank %d wrote %d shards, %.1f MB in %.2fs", rank, len(shards), nbytes / 1e6, time.perf_counter() - start)
    return nbytes


def write_metadata(storage: Storage, docs: list[tuple[str, bytes]]) -> int:
    """Write group and array ``zarr.json`` documents (``plan.metadata_docs``): after every rank's
    shards, so a generic Zarr reader never finds an array whose chunks are still missing."""
    return sum(storage.run_all(lambda doc: _put(storage, doc[0], [doc[1]]), docs, writing=True))


def commit_save(storage: Storage, group: Group, plan: ZarrSavePlan, save_id: str, written: integrity.Written) -> None:
    """After every rank wrote its shards: the ``zarr.json`` documents, then rank 0 commits the
    manifest with the record of every chunk written (gathered from all ranks, one collective)."""
    views = group.gather_json(integrity.to_json(written))
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
    written: Sequence[Mapping[str, Mapping[str, str]]],
    *,
    library: str | None = None,
    dcp: dict[str, Any] | None = None,
) -> Manifest:
    """The manifest a commit writes (every save path builds it here): arrays and values in key
    order, the commit time, the writing library, and the record of every chunk ``written`` (each
    writer's :func:`zarrckpt.integrity.to_json`); raises when some shard was written by no one."""
    return Manifest(
        save_id,
        dict(sorted(arrays.items())),
        dict(sorted(values.items())),
        world_size,
        protocol.now(),
        library or library_name(),
        dcp or {},
        integrity.records(arrays, written),
    )


def _put(storage: Storage, path: str, parts: list[bytes] | list[Any]) -> int:
    """Create one object; another writer's object already there means this save lost a race."""
    try:
        storage.write(path, parts, create_only=storage.atomic_create)
    except FileExistsError:
        raise CheckpointExistsError(
            f"another save is writing to {storage.url!r}: {path} was created by another writer; "
            "this save is abandoned uncommitted"
        ) from None
    return sum(len(p) for p in parts)
