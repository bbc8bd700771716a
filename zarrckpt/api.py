"""``save`` and ``load``: plan -> write -> commit, and open -> plan -> read."""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence, Set
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import commit as protocol
from . import dtypes, integrity, stateful, values
from .dist import Group
from .errors import LayoutMismatchError, ZarrckptError
from .fanread import read_shared
from .format import MANIFEST, ArrayMeta, Manifest
from .keys import Path, flat_key, iter_leaves, nest, set_leaf
from .layout import Box
from .localstate import BYTES_TYPES, collect, is_tensor_target, tensor_info, tensor_parts
from .plan import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES
from .reader import Request, allocate, read_regions
from .storage import Storage
from .types import URL, ArrayKind
from .writer import commit_save, plan_save, write_rank

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger("zarrckpt")


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
) -> None:
    """Save ``state_dict`` as a Zarr v3 checkpoint at ``url``; every rank calls it.

    Each rank writes only the shards it owns; a replicated region is written once, by its
    lowest rank. Returns once the checkpoint is committed.

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
            this save then fails, both are lost. Without it an existing checkpoint is an error.
        chunk_bytes: the target size of an inner chunk (the unit of a read and of a checksum).
        small_tensor_bytes: parts smaller than this (ranks' blocks of a tensor) are joined into
            objects of at least this size (a smaller tensor: one object), each written by one of
            its holders, which the others send their parts (one exchange per save); 0 writes
            every rank's part as objects of its own.
        check_replicas: ranks holding the same block compare a crc32c digest of all its bytes
            (about 0.1 s per GiB per rank); ``False`` skips that for large DDP-style replicas.
        allow_pickle: store values of other types (arbitrary classes) pickled, marked as such;
            loading them needs ``load(..., allow_pickle=True)``. Without it they raise
            ``UnsupportedValueError`` naming the key and type, before anything is written.

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
        IncompleteCheckpointError: ``overwrite`` is False and ``url`` holds another save in
            progress (or one that died before committing), or a deletion in progress.
        StorageError: the storage refused or failed a request (bucket, permissions, network).
        ZarrckptError: ``url`` holds files that are not a zarrckpt checkpoint (refused, even with
            ``overwrite``), or the save failed on another rank (named in the message).
    """
    group = Group(process_group)
    start = time.perf_counter()
    resolved, _ = stateful.resolve(state_dict)
    local = group.run_together(lambda: collect(resolved, allow_pickle), "collecting the state dict")
    plan = plan_save(group, local, chunk_bytes, check_replicas, small_tensor_bytes)
    storage = Storage(url, storage_options)
    save_id = group.run_together(lambda: protocol.prepare(storage, overwrite) if group.rank == 0 else "", "preparing")
    written: integrity.Written = {}
    nbytes = group.run_together(lambda: write_rank(storage, plan, local, group.rank, written), "writing shards")
    commit_save(storage, group, plan, save_id, written)
    log.info(
        "saved %s: %d tensors, this rank wrote %.1f MB in %.2fs",
        storage.url,
        len(plan.arrays),
        nbytes / 1e6,
        time.perf_counter() - start,
    )


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
) -> None:
    """Load the checkpoint at ``url`` into ``state_dict`` in place; every rank calls it.

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
        allow_modified: load a checkpoint that another tool changed after it was committed, as it
            is now (chunks in any valid shard layout, each chunk's crc32c still checked). Without
            it, loading a tensor or value that changed raises ``ModifiedCheckpointError``
            before anything is loaded.
        fan_out: a region that several ranks need (replicas: DDP, HSDP, replicated experts, plain
            tensors on every rank) is read from storage by one of them and sent to the others over
            the process group (:mod:`zarrckpt.fanread`); ``False``: every rank reads all it needs.

    Raises:
        LayoutMismatchError: the target does not match the checkpoint (keys, shapes, dtypes);
            ``.differences`` lists every difference. Nothing is loaded.
        CorruptChunkError: a shard object is missing, truncated or fails a checksum.
        ModifiedCheckpointError: chunks or metadata to load differ from what was committed.
        UnsupportedValueError: a value to load was saved pickled and ``allow_pickle`` is False.
        CheckpointNotFoundError: nothing at all is stored at ``url``.
        IncompleteCheckpointError: nothing was committed at ``url``, or it was overwritten meanwhile.
        InvalidCheckpointError: the checkpoint's metadata is malformed or of a newer format version.
        StorageError: the storage refused or failed a request (bucket, permissions, network).
        ZarrckptError: the load failed on another rank (named in the message).
    """
    group = Group(process_group)
    storage = Storage(url, storage_options)
    # one GET per job: rank 0 reads the manifest, every rank parses the same bytes
    raw = group.on_rank0(lambda: protocol.read_manifest_bytes(storage), "opening the checkpoint")
    manifest = group.run_together(lambda: Manifest.loads(raw, storage.where(MANIFEST)), "opening the checkpoint")
    manifest = manifest.as_is() if allow_modified else manifest
    state_dict, after_load = stateful.resolve(state_dict)
    start = time.perf_counter()
    leaves = {flat_key(path): (path, value) for path, value in iter_leaves(state_dict)}
    if keys is not None:
        leaves = {k: leaf for k, leaf in leaves.items() if _selected(k, keys)}
    saved = manifest.arrays.keys() | manifest.values.keys()
    subtrees = _value_subtrees(leaves, manifest)
    mismatches = [d for key, (_, v) in leaves.items() if key in saved for d in _compare(key, v, manifest, cast)]
    empty = _empty_targets(leaves, manifest)
    requested = sorted((leaves.keys() - subtrees.keys()) | {k for ks in subtrees.values() for k in ks})
    views = group.all_gather_json({"keys": requested, "mismatches": mismatches + list(empty.values())})
    mismatches = sorted({m for v in views for m in v["mismatches"]})
    wanted = {k for v in views for k in v["keys"]}
    considered = _considered(saved, wanted, keys)
    missing, unexpected = sorted(wanted - saved - empty.keys()), sorted(considered - wanted)
    unexpected = [k for k in unexpected if not k.startswith(tuple(e + "." for e in empty))]  # said once, above
    if (skipped := saved - considered) and group.rank == 0:
        tops = sorted({k.split(".")[0] for k in skipped})
        log.info("not loading %d saved keys the target does not ask for (under %s)", len(skipped), ", ".join(tops))
    if mismatches or (strict and (missing or unexpected)):
        diffs = mismatches + [f"{k}: expected, not in the checkpoint" for k in missing]
        diffs += [f"{k}: in the checkpoint, not expected" for k in unexpected] if strict else []
        raise LayoutMismatchError(
            f"the state dict does not match the checkpoint at {storage.url!r} (saved vs expected):\n  "
            + "\n  ".join(diffs[:100])
            + ("" if len(diffs) <= 100 else f"\n  ... and {len(diffs) - 100} more")
            + "\nA different model is a model conversion, not a topology change; "
            "strict=False loads only the keys both sides have.",
            diffs,
        )
    integrity.refuse_modified(manifest.modified, sorted(wanted & saved), storage.url)  # same on every rank
    if (missing or unexpected) and group.rank == 0:
        log.warning("loaded with strict=False; not in the checkpoint: %s; not loaded: %s", missing, unexpected)

    def decode_values() -> tuple[dict[str, Any], dict[str, Any]]:  # before anything changes: may refuse a pickle
        def dec(key: str, like: Any = None) -> Any:
            return values.decode(manifest.values[key], like, key=key, allow_pickle=allow_pickle)

        plain = {key: dec(key, leaves[key][1]) for key in manifest.values if key in leaves}
        nested = {key: nest({k[len(key) + 1 :]: dec(k) for k in under}) for key, under in subtrees.items()}
        return plain, nested

    plain, nested = group.run_together(decode_values, "decoding the saved values")
    requests, finish = _plan_targets(leaves, manifest, state_dict)
    try:
        if fan_out:
            nbytes = read_shared(group, storage, manifest, requests, any_layout=allow_modified)
        else:
            nbytes = group.run_together(lambda: read_regions(storage, requests, any_layout=allow_modified), "reading")
    except ZarrckptError:
        _check_unchanged(group, storage, manifest.save_id)  # an overwrite explains it better
        raise
    if not integrity.reads_are_checked(list(manifest.arrays.values()), allow_modified):
        _check_unchanged(group, storage, manifest.save_id)  # else every chunk used was the committed one
    for fn in finish:
        fn()
    for key, value in (plain | nested).items():
        set_leaf(state_dict, leaves[key][0], value)
    after_load()
    log.info("loaded %s: this rank read %.1f MB in %.2fs", storage.url, nbytes / 1e6, time.perf_counter() - start)


def _check_unchanged(group: Group, storage: Storage, save_id: str) -> None:
    """The end-of-load check (the manifest is still this save's), by rank 0 for every rank."""

    def check() -> bytes:
        protocol.check_unchanged(storage, save_id)
        return b""

    group.on_rank0(check, "checking that the checkpoint is unchanged")


def _selected(key: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def _considered(saved: Set[str], wanted: Set[str], patterns: Sequence[str] | None) -> set[str]:
    """The saved keys a load must account for: those matching ``patterns``; without patterns,
    all but the top-level subtrees (``model``, ``optim``, ...) the target has no key in."""
    if patterns is not None:
        return {k for k in saved if _selected(k, patterns)}
    tops = {k.split(".")[0] for k in wanted}
    return {k for k in saved if "." not in k or k.split(".")[0] in tops}


def _empty_targets(leaves: dict[str, Any], manifest: Manifest) -> dict[str, str]:
    """Target entries that are empty dicts where the checkpoint holds tensors (they would load nothing): key -> why."""
    out = {}
    for key, (_, value) in leaves.items():
        if isinstance(value, Mapping) and not value and key not in manifest.arrays:
            under = sorted(k for k in manifest.arrays if k.startswith(key + "."))
            if under:
                out[key] = (
                    f"{key}: the target is an empty dict, the checkpoint holds {len(under)} tensors under it "
                    f"({', '.join(under[:2])}{', ...' if len(under) > 2 else ''}); build a target that holds them: "
                    "for an optimizer, torch.distributed.checkpoint.state_dict.get_state_dict(model, optim) "
                    "gives one with its state initialised (a fresh optimizer's state_dict() has none)"
                )
    return out


def _value_subtrees(leaves: dict[str, Any], manifest: Manifest) -> dict[str, list[str]]:
    """Target leaves that stand for a saved dict of plain values (``"config": {}`` or ``None``).

    Such a leaf is replaced by the whole saved dict, so trainer state can be loaded without
    spelling out every key.
    """
    out: dict[str, list[str]] = {}
    for key, (_, value) in leaves.items():
        if key in manifest.values or key in manifest.arrays or not (value is None or isinstance(value, Mapping)):
            continue
        under = [k for k in manifest.values if k.startswith(key + ".")]
        if under and not any(k.startswith(key + ".") for k in manifest.arrays):
            out[key] = under
    return out


def _compare(key: str, value: Any, manifest: Manifest, cast: bool = False) -> list[str]:
    """How a target leaf differs from what was saved under ``key`` (empty when it can be loaded)."""
    meta = manifest.arrays.get(key)
    if meta is None:  # saved as a plain value
        if is_tensor_target(value) or isinstance(value, (np.ndarray, *BYTES_TYPES)):
            return [f"{key}: saved a plain value, expected a {type(value).__name__}"]
        return []
    if meta.kind == ArrayKind.BYTES:
        return [] if isinstance(value, BYTES_TYPES) else [f"{key}: saved bytes, expected {type(value).__name__}"]
    if meta.kind == ArrayKind.NDARRAY and isinstance(value, np.ndarray):
        shape, dtype = tuple(value.shape), dtypes.zarr_name(torch.from_numpy(np.empty(0, value.dtype)).dtype)
    elif is_tensor_target(value):
        shape, torch_dtype = tensor_info(value)
        dtype = dtypes.zarr_name(torch_dtype)
    else:
        return [f"{key}: saved a {meta.kind} {list(meta.shape)} {meta.dtype}, expected a {type(value).__name__}"]
    out = []
    if shape != meta.shape:
        out.append(f"{key}: shape {list(meta.shape)} saved vs {list(shape)} expected")
    if dtype != meta.dtype and not (cast and is_tensor_target(value)):
        out.append(f"{key}: dtype {meta.dtype} saved vs {dtype} expected (load(..., cast=True) converts)")
    return out


def _plan_targets(
    leaves: dict[str, Any], manifest: Manifest, state_dict: MutableMapping[str, Any]
) -> tuple[list[Request], list[Callable[[], Any]]]:
    """Read requests for every array target, and what to run once the data is in."""
    requests: list[Request] = []
    finish: list[Callable[[], Any]] = []
    for key, (path, value) in leaves.items():
        meta = manifest.arrays.get(key)
        if meta is None:
            continue
        if meta.kind == ArrayKind.BYTES:
            buf = allocate(meta)
            requests.append(Request(meta, Box.full(meta.shape), buf))
            finish.append(partial(_set_bytes, state_dict, path, buf, type(value)))
        elif isinstance(value, np.ndarray):
            requests.append(Request(meta, Box.full(meta.shape), value.view(dtypes.storage_dtype(meta.dtype))))
        else:
            requests += [_tensor_request(meta, box, data, finish) for data, _, box, _ in tensor_parts(value)]
    return requests, finish


def target_boxes(meta: ArrayMeta, value: Any) -> list[Box]:
    """The regions of the saved array ``meta`` that a target leaf receives: all of it for bytes and
    numpy arrays, the tensor's own parts (its shard, for a DTensor) otherwise. Pure; the scale
    model plans loads with it."""
    if meta.kind == ArrayKind.BYTES or isinstance(value, np.ndarray):
        return [Box.full(meta.shape)]
    return [box for _, _, box, _ in tensor_parts(value)]


def _set_bytes(state_dict: MutableMapping[str, Any], path: Path, buf: np.ndarray, make: type) -> None:
    set_leaf(state_dict, path, make(buf.tobytes()))


def _tensor_request(meta: ArrayMeta, box: Box, target: torch.Tensor, finish: list[Callable[[], Any]]) -> Request:
    """Read straight into a CPU target of the stored dtype; else into a staging buffer of the
    stored dtype, copied (converted, moved to the GPU) once the data is in."""
    stored = dtypes.torch_dtype(meta.dtype)
    if target.device.type == "cpu" and target.dtype == stored:
        return Request(meta, box, dtypes.as_numpy(target.detach()))
    staging = torch.empty(
        target.shape, dtype=stored, pin_memory=target.device.type != "cpu" and torch.cuda.is_available()
    )
    finish.append(lambda: target.detach().copy_(staging, non_blocking=False))
    return Request(meta, box, dtypes.as_numpy(staging))
