"""``save`` and ``load``: plan -> write -> commit, and open -> plan -> read.

Each is a short pipeline over the layers below: the plans are :mod:`zarrckpt.engine.saveplan` (over
:mod:`zarrckpt.plan.save`) and :mod:`zarrckpt.plan.targets`, the I/O :mod:`zarrckpt.engine.writer`
and :mod:`zarrckpt.engine.loader`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from zarrckpt.display import ProgressOption, watch
from zarrckpt.engine import commit as protocol
from zarrckpt.engine import loader, markers
from zarrckpt.engine.dist import Group
from zarrckpt.engine.saveplan import plan_save
from zarrckpt.engine.writer import commit_save
from zarrckpt.format import integrity
from zarrckpt.format.gcpause import gc_paused
from zarrckpt.format.layout import chunk_rule
from zarrckpt.format.manifest import Manifest
from zarrckpt.plan import stateful, targets
from zarrckpt.plan.localstate import collect
from zarrckpt.plan.names import check_names
from zarrckpt.plan.save import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES
from zarrckpt.staging import save_budget, write_local
from zarrckpt.storage.store import Storage
from zarrckpt.types import URL

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger("zarrckpt")


@gc_paused()  # the caller waits: 20,000 tensors make millions of small objects, none in a cycle
def save(
    state_dict: Mapping[str, Any],
    url: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: ProcessGroup | None = None,
    overwrite: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    small_tensor_bytes: int = DEFAULT_SMALL_TENSOR_BYTES,
    check_replicas: bool = True,
    allow_pickle: bool = False,
    verify_after_save: bool | None = None,
    progress: ProgressOption = False,
    staging_budget_bytes: int | None = None,
    chunk_policy: str = "rows",
) -> dict[str, int]:
    """Save ``state_dict`` as a Zarr v3 checkpoint at ``url``; every rank calls it.

    Each rank writes only the shards it owns; a replicated region is written once, by its
    lowest rank. Returns once the checkpoint is committed, with what the save cost the store on
    this rank (as :meth:`zarrckpt.Checkpoint.stats`): ``{"requests", "retries", "bytes_read",
    "bytes_written"}``; every attempt of a request counts (a retried one twice, and once in
    ``retries``), bytes are those of object bodies.

    Tensors on the CPU are written straight from their memory. Tensors elsewhere (GPU) are copied
    to pinned host buffers on the calling thread, each written as soon as it lands, with at most
    ``staging_budget_bytes`` staged but not yet written (a part larger than that alone): no host
    copy of the whole state is made, and the copies overlap the writes (:mod:`zarrckpt.staging`).

    Args:
        state_dict: a nested dict of tensors (plain, DTensor or :class:`~zarrckpt.LocalShard`),
            numpy arrays, byte strings and plain values (numbers, strings, lists, dicts, ...);
            objects with ``state_dict()`` / ``load_state_dict()`` (a model, an optimizer) are
            saved as their ``state_dict()``. Keys are flattened with dots, as DCP does.
        url: where to save: a local path or any fsspec URL (``s3://bucket/run/step_100``).
        storage_options: passed to fsspec for ``url`` (credentials, endpoint, ...).
        process_group: the ranks taking part; None: the default group (one process when
            ``torch.distributed`` is not initialised).
        overwrite: replace a committed checkpoint (or the leftovers of a failed save) at ``url``.
            The old checkpoint is un-committed and deleted *before* the new one is written: if
            this save then fails, both are lost. Without it an existing checkpoint is an error. A
            save still running there is never replaced (``IncompleteCheckpointError``).
        chunk_bytes: the largest inner chunk (the unit of a read and of a checksum); a shard under 8x this
            is cut into about 8 inner chunks of at least 256 KiB, so that a load into another layout wastes little.
        chunk_policy: ``"rows"`` (default): a 2-D shard's inner chunks are row bands as wide as the
            shard; ``"tiles"``: bands of at least 512 KiB are cut into up to 8 column tiles (of at
            least 256 KiB), so that a lazy column slice of a row-sharded matrix reads about an
            eighth of it, not all of it, while a load into another layout reads the same bytes (in
            8x as many chunks: from local disk such a load took about 1.5x as long,
            ``benchmarks/column_slices.py``). See FORMAT.md §4 and docs/exploring.md.
        small_tensor_bytes: parts smaller than this (ranks' blocks of a tensor) are joined into
            objects of at least this size (a smaller tensor: one object), each written by one of
            its holders, which the others send their parts (one exchange per save); 0 writes
            every rank's part as objects of its own.
        check_replicas: ranks holding the same block compare a crc32c digest of all its bytes
            (about 0.1 s per GiB per rank); ``False`` skips that for large DDP-style replicas.
        allow_pickle: store values of other types (arbitrary classes) pickled, marked as such;
            loading them needs ``load(..., allow_pickle=True)``. Without it they raise
            ``UnsupportedValueError`` naming the key and type, before anything is written.
        verify_after_save: every object is checked end to end as it is written (S3: ``Content-MD5``
            and the ETag the PUT returns; GCS: the crc32c of the upload's answer) and written again
            when it arrived damaged; None (default) reads back, before the commit, only the objects
            no such check covered (``memory://``, other fsspec stores, multipart uploads, KMS-encrypted
            buckets); True reads every object back; False none.
        progress: ``True``: a progress line with rate and ETA on stderr (rank 0's writes); a callable
            ``fn(done_bytes, total_bytes)``: called on every rank after each object it writes (from
            I/O threads) and once at the end with ``done_bytes == total_bytes``.
        staging_budget_bytes: the bound on host memory holding copies of GPU tensors not yet written;
            None: ``$ZARRCKPT_SAVE_STAGING_BYTES``, else 512 MiB. Buffers are kept for the next save
            up to this size (``zarrckpt.release_staging()`` frees them).

    Raises:
        SaveLayoutError: the ranks' tensors do not cover every global tensor exactly once, ranks
            disagree on a value, or replicas differ; nothing is written.
        UnsupportedValueError: a value cannot be stored without pickle (and ``allow_pickle`` is
            False), has an unsupported dtype, or is a DTensor with a ``Partial`` placement;
            nothing is written.
        InvalidKeyError: a key cannot be stored (an empty segment, ``..``, a leading ``__``, a
            ``/``, or a key that is also the prefix of another); nothing is written.
        CheckpointExistsError: a checkpoint exists and ``overwrite`` is False, or another save
            took the location over (of two racing saves, exactly one commits).
        IncompleteCheckpointError: ``url`` holds another save in progress (or, without
            ``overwrite``, one that died less than the lease ago), or a deletion in progress.
        StorageError: the storage refused or failed a request (bucket, permissions, network).
        ZarrckptError: ``url`` holds files that are not a zarrckpt checkpoint (refused, even with
            ``overwrite``), or the save failed on another rank (named in the message).
    """
    return _save(
        state_dict,
        url,
        storage_options=storage_options,
        process_group=process_group,
        overwrite=overwrite,
        chunk_bytes=chunk_bytes,
        small_tensor_bytes=small_tensor_bytes,
        check_replicas=check_replicas,
        allow_pickle=allow_pickle,
        verify_after_save=verify_after_save,
        progress=progress,
        staging_budget_bytes=staging_budget_bytes,
        chunk_policy=chunk_policy,
    )


def _save(
    state_dict: Mapping[str, Any],
    url: URL,
    *,
    storage_options: dict[str, Any] | None,
    process_group: ProcessGroup | None,
    overwrite: bool,
    chunk_bytes: int,
    small_tensor_bytes: int,
    check_replicas: bool,
    allow_pickle: bool,
    verify_after_save: bool | None,
    progress: ProgressOption,
    staging_budget_bytes: int | None,
    chunk_policy: str = "rows",
    force_gather: bool = False,
) -> dict[str, int]:
    """:func:`save`; ``force_gather`` (tests): plan from every rank's gathered description, as
    before issue 28 (:func:`zarrckpt.engine.saveplan.plan_save`)."""
    rule = chunk_rule(chunk_bytes, chunk_policy)
    group = Group(process_group)
    start = time.perf_counter()
    budget = save_budget(staging_budget_bytes)
    resolved, _ = stateful.resolve(state_dict)
    local = group.run_together(
        lambda: collect(resolved, allow_pickle, group.rank, group.size), "collecting the state dict"
    )
    storage = Storage(url, storage_options, verify_writes=verify_after_save)
    names = partial(check_names, limits=storage.name_limits, where=storage.url)  # before anything is written
    plan = plan_save(group, local, rule, check_replicas, small_tensor_bytes, check=names, force_gather=force_gather)
    whole = plan.total_bytes() if progress is True and group.rank == 0 else None  # (rank 0's plan: every array)
    bar = watch(storage, progress, f"save {storage.url}", plan.bytes_of(group.rank), group.rank, group.size, whole)
    save_id = group.run_together(
        lambda: protocol.prepare(storage, overwrite, group.size) if group.rank == 0 else "", "preparing", share=True
    )
    storage.guard = markers.Ownership(storage, save_id).check  # a save whose location is taken stops writing
    written: integrity.Written = {}
    try:
        nbytes = group.run_together(
            lambda: write_local(storage, plan, local, group.rank, written, budget=budget), "writing shards"
        )
        commit_save(storage, group, plan, save_id, written)
    except BaseException:
        markers.abandon(storage, save_id)  # rank 0: the heartbeat stops, and the next save may take it over
        bar.abort()
        raise
    bar.finish()
    log.info(
        "saved %s: %d tensors, this rank wrote %.1f MB in %.2fs",
        storage.url,
        len(plan.arrays),
        nbytes / 1e6,
        time.perf_counter() - start,
    )
    return storage.traffic.snapshot()


def load(
    state_dict: MutableMapping[str, Any],
    url: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: ProcessGroup | None = None,
    strict: bool = True,
    keys: Sequence[str] | None = None,
    cast: bool = False,
    allow_pickle: bool = False,
    allow_modified: bool = False,
    fan_out: bool = True,
    progress: ProgressOption = False,
    per_rank: str = "error",
) -> dict[str, int]:
    """Load the checkpoint at ``url`` into ``state_dict`` in place; every rank calls it. Returns what
    the load cost the store on this rank, as :func:`save` does (``bytes_read``: index and
    read-through bytes included; what other ranks sent it, with ``fan_out``, not).

    Tensors (plain or DTensor local shards, any sharding) are filled in place, reading only the
    chunks they need; non-tensor values are replaced, restored to their saved Python type.
    Shape or kind differences always raise ``LayoutMismatchError``.

    Which keys must match: the target may leave out whole top-level subtrees of the checkpoint
    (``{"model": ...}`` from a checkpoint of ``model``, ``optim`` and ``trainer``: they are
    skipped, logged at INFO); inside every top-level subtree the target holds, and for top-level
    leaves, key sets must match exactly, so a model with fewer layers or experts is refused as a
    model conversion. A target entry that is an empty dict where the checkpoint holds tensors (a
    fresh optimizer's ``state``) is always an error: it would load nothing.

    Args:
        state_dict: the target, shaped like what was saved: tensors (plain, DTensor or
            :class:`~zarrckpt.LocalShard`, on any device) are filled in place; objects with
            ``state_dict()`` / ``load_state_dict()`` receive theirs.
        url: the checkpoint: a local path or any fsspec URL.
        storage_options: passed to fsspec for ``url`` (credentials, endpoint, ...).
        process_group: the ranks taking part; None: the default group (one process when
            ``torch.distributed`` is not initialised). Any number of ranks can load a checkpoint,
            whatever number saved it.
        strict: ``False`` loads the keys both sides have and logs the rest.
        keys: fnmatch patterns (``["model.*"]``): only the target's and the checkpoint's keys
            matching one of them take part; the rest of the target is left untouched.
        cast: a tensor of another dtype than the saved one receives the saved values converted
            as ``target.copy_(saved)`` would (read in the stored dtype, then converted). Without
            it a dtype difference is a ``LayoutMismatchError``.
        allow_pickle: load values that were saved with ``save(..., allow_pickle=True)``. This runs
            code from the checkpoint: only for checkpoints you trust. Without it such a value
            raises ``UnsupportedValueError`` before anything is loaded.
        allow_modified: load a checkpoint that another tool changed after it was committed, or
            one without a commit record (no ``integrity`` or no ``attributes_crc32c`` in its
            manifest: written before zarrckpt recorded one, or with the record removed), as it is
            now (chunks in any valid shard layout, each chunk's crc32c still checked; an
            unrecorded checkpoint is logged as loaded unchecked). Without it, loading a tensor or
            value that changed, or anything of an unrecorded checkpoint, raises
            ``ModifiedCheckpointError`` before anything is loaded.
        fan_out: a region that several ranks need (replicas: DDP, HSDP, replicated experts, plain
            tensors on every rank) is read from storage by one of them and sent to the others over
            the process group (:mod:`zarrckpt.engine.fanread`); ``False``: every rank reads all it needs.
            Planning it gathers every rank's requests: a job with more than a million requests in all
            (thousands of ranks) is not fanned out (logged at INFO).
        progress: as for :func:`save`: the bytes this rank reads or receives from other ranks, of
            the bytes its tensors take (index and read-through bytes can run a little past it).
        per_rank: what :class:`~zarrckpt.PerRank` targets receive when this load runs on another
            number of ranks than the save: ``"error"`` (default) raises ``LayoutMismatchError``
            naming the keys; ``"modulo"``: rank r takes the row of saved rank r % saved world size;
            ``"skip"``: they are left as they are (to reseed). On the same number of ranks each
            rank always receives its own row.

    Raises:
        LayoutMismatchError: the target does not match the checkpoint (keys, shapes, dtypes);
            ``.differences`` lists every difference. Nothing is loaded.
        CorruptChunkError: a shard object is missing, truncated or fails a checksum.
        ModifiedCheckpointError: chunks or metadata to load differ from what was committed, or the
            checkpoint has no commit record to compare them with (and ``allow_modified`` is False).
        UnsupportedValueError: a value to load was saved pickled and ``allow_pickle`` is False.
        CheckpointNotFoundError: nothing at all is stored at ``url``.
        IncompleteCheckpointError: nothing was committed at ``url``, or it was overwritten meanwhile.
        InvalidCheckpointError: the checkpoint's metadata is malformed or of a newer format version.
        StorageError: the storage refused or failed a request (bucket, permissions, network).
        ZarrckptError: the load failed on another rank (named in the message).
    """
    group = Group(process_group)
    storage = Storage(url, storage_options)
    manifest = loader.open_manifest(group, storage, allow_modified=allow_modified)
    read = partial(loader.read, group, storage, fan_out=fan_out, allow_modified=allow_modified)
    return load_from(
        state_dict,
        group,
        storage,
        manifest,
        read,
        strict=strict,
        keys=keys,
        cast=cast,
        allow_pickle=allow_pickle,
        allow_modified=allow_modified,
        progress=progress,
        per_rank=per_rank,
    )


Read = Callable[..., int]  # (manifest, requests, *, on_received) -> the bytes this rank fetched


def load_from(
    state_dict: MutableMapping[str, Any],
    group: Group,
    storage: Storage,
    manifest: Manifest,
    read: Read,
    *,
    strict: bool = True,
    keys: Sequence[str] | None = None,
    cast: bool = False,
    allow_pickle: bool = False,
    allow_modified: bool = False,
    progress: ProgressOption = False,
    per_rank: str = "error",
) -> dict[str, int]:
    """:func:`load` of an opened ``manifest`` whose requests ``read`` fills (every rank calls it):
    :func:`zarrckpt.engine.loader.read` from ``storage``, or a local tier's restore
    (:mod:`zarrckpt.tier.restore`)."""
    state_dict, after_load = stateful.resolve(state_dict)
    start = time.perf_counter()
    matched = targets.match(
        state_dict, manifest, keys=keys, cast=cast, rank=group.rank, world=group.size, per_rank=per_rank
    )
    agreed = loader.agree(group, matched, manifest, keys=keys, strict=strict, url=storage.url)
    integrity.refuse_modified(manifest.modified, agreed.found, storage.url)  # same on every rank
    if group.rank == 0:
        if agreed.skipped:
            tops = ", ".join(sorted({k.split(".")[0] for k in agreed.skipped}))
            log.info("not loading %d saved keys the target does not ask for (under %s)", len(agreed.skipped), tops)
        if agreed.missing or agreed.unexpected:
            log.warning(
                "loaded with strict=False; not in the checkpoint: %s; not loaded: %s", agreed.missing, agreed.unexpected
            )
    decoded = group.run_together(  # before anything changes: may refuse a pickle
        lambda: targets.decode_values(matched, manifest, allow_pickle=allow_pickle), "decoding the saved values"
    )
    requests, finish = targets.plan_requests(matched, manifest, state_dict, allow_pickle=allow_pickle)
    total = sum(r.dest.nbytes for r in requests)
    bar = watch(storage, progress, f"load {storage.url}", total, group.rank, group.size)
    try:
        nbytes = read(manifest, requests, on_received=bar.advance if bar.active else None)
    except BaseException:
        bar.abort()
        raise
    bar.finish()
    for fn in finish:
        fn()
    targets.set_values(state_dict, matched, decoded)
    after_load()
    log.info("loaded %s: this rank read %.1f MB in %.2fs", storage.url, nbytes / 1e6, time.perf_counter() - start)
    return storage.traffic.snapshot()
