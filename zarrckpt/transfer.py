"""Copy a committed checkpoint to another location or store, checked end to end: ``zarrckpt cp``.

The copy is a save at the destination and follows the commit protocol (:mod:`zarrckpt.engine.commit`):
a pending marker first, then every object of the source (each read once, written with the store's
upload checks), then every chunk at the destination read back and checked against the source's
commit record, and only then the manifest. A copy that fails or finds a problem never commits: its
leftover is listed as incomplete and ``zarrckpt gc`` collects it.

A copy never mints a commit record for bytes no record checked: a source without one (or changed
after its commit) is refused, and with ``allow_modified=True`` copied as it is and committed without
a record, so that the copy is refused the same way wherever it lands.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from zarrckpt.checkpoint import Checkpoint
from zarrckpt.display import Progress
from zarrckpt.engine import commit as protocol
from zarrckpt.engine import markers
from zarrckpt.errors import CorruptChunkError, ModifiedCheckpointError, ZarrckptError
from zarrckpt.format import integrity
from zarrckpt.format.manifest import DELETING, MANIFEST, PENDING
from zarrckpt.storage.store import Storage
from zarrckpt.types import URL

_MARKERS = {MANIFEST, PENDING, DELETING, integrity.TABLE}  # (the copy's commit writes its own table)
log = logging.getLogger("zarrckpt")


def copy_checkpoint(
    src: URL,
    dst: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: bool = False,
    allow_modified: bool = False,
) -> dict[str, Any]:
    """Copy the committed checkpoint at ``src`` to ``dst`` (any store to any store), checked end to end.

    Every object is read once from ``src`` and written to ``dst``; then every chunk at ``dst`` is read
    back and checked against the commit record ``src`` was committed with (the bytes that arrived,
    not the bytes sent), and only then is the copy committed, under a save id of its own. A source
    that is corrupt, or a copy that arrived damaged, fails the copy and commits nothing.

    Args:
        src: a committed checkpoint.
        dst: where the copy goes: absent or empty, or (``overwrite``) a checkpoint to replace.
        storage_options: fsspec options for ``src``.
        dst_storage_options: fsspec options for ``dst`` (default: none).
        overwrite: replace a checkpoint at ``dst`` (deleted first, by the deletion protocol).
        progress: a progress line with rate and ETA on stderr meanwhile.
        allow_modified: copy a source without a commit record (written before zarrckpt recorded
            one, or with the record removed), or one changed after its commit, as it is now: every
            chunk that arrives is checked against its own crc32c only, and the copy is committed
            **without** a commit record (logged), so reading it needs ``allow_modified=True`` too.
            A copy whose every chunk matches the source's record is committed with it either way
            (a source whose chunks do not is read twice).

    Returns:
        ``{"src", "dst", "objects", "bytes", "bytes_checked", "tensors", "seconds", "recorded"}``;
        ``recorded`` is False for a copy committed without a commit record (``allow_modified``).

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, InvalidCheckpointError: ``src`` holds no
            committed checkpoint.
        ModifiedCheckpointError: ``src`` has no commit record, or was changed after it was
            committed (and ``allow_modified`` is False); nothing is written.
        CheckpointExistsError: ``dst`` holds a checkpoint and ``overwrite`` is False.
        CorruptChunkError: the copy does not verify (the problems are listed); nothing was committed.
        StorageError: a request failed; nothing was committed.
    """
    start = time.perf_counter()
    source, target = Storage(src, storage_options), Storage(dst, dst_storage_options)
    if source.url.rstrip("/") == target.url.rstrip("/") and storage_options == dst_storage_options:
        raise ZarrckptError(f"refusing to copy {source.url!r} onto itself")
    manifest = protocol.read_manifest(source, table=True)
    unrecorded = integrity.unrecorded(manifest.modified)
    if unrecorded and not allow_modified:
        raise ModifiedCheckpointError(
            f"not copying {source.url!r}: {unrecorded}. A copy is committed with a commit record only when that "
            "record checked its bytes, and nothing can check these; allow_modified=True (`zarrckpt cp "
            "--allow-modified`) copies it as it is, committed without a record, so that reading the copy needs "
            "allow_modified=True too",
            key="",
        )
    if manifest.modified and not allow_modified:
        changed = ", ".join(sorted(k or "(the attributes)" for k in manifest.modified))
        raise ModifiedCheckpointError(
            f"not copying {source.url!r}: it was changed after commit ({changed}); allow_modified=True "
            "(`zarrckpt cp --allow-modified`) copies it as it is now, without a commit record",
            key=min(manifest.modified),
        )
    objects = {path: size for path, size in source.sizes().items() if path not in _MARKERS}
    save_id = protocol.prepare(target, overwrite, 1)
    try:
        bar = Progress("cp", len(objects), sum(objects.values()), unit="objects") if progress else None

        def move(path: str) -> int:
            data = source.read(path, 0)
            target.write(path, [data])
            if bar is not None:
                bar.advance(1, len(data))
            return len(data)

        moved = sum(target.run_all(move, sorted(objects), writing=True))
        if bar is not None:
            bar.finish(moved)
        recorded = not manifest.modified
        if recorded:  # every chunk that arrived, against the record the source was committed with
            copy = dataclasses.replace(manifest, save_id=save_id)
            checked = Checkpoint(target, copy).verify(progress=progress)
            recorded = not (checked["problems"] and allow_modified)  # (chunks another tool rewrote, say)
        if not recorded:  # never a record (nor attributes_crc32c) for what no record checked
            log.warning(
                "copying %s as it is now (allow_modified=True): %s; each chunk is checked against its own crc32c "
                "only, and the copy at %s is committed without a commit record",
                source.url,
                unrecorded or "it does not match its commit record",
                target.url,
            )
            why = unrecorded or integrity.Unrecorded(f"copied from {source.url} as it was, by allow_modified=True")
            copy = dataclasses.replace(manifest.as_is(warn=False), save_id=save_id, integrity=None, unrecorded=why)
            checked = Checkpoint(target, copy, allow_modified=True).verify(progress=progress)
        if checked["problems"]:
            shown = "\n  - ".join(checked["problems"][:8])
            raise CorruptChunkError(
                f"the copy of {source.url!r} at {target.url!r} does not verify, so it was not committed "
                f"({len(checked['problems'])} problem(s)):\n  - {shown}\n(`zarrckpt verify {source.url}` tells "
                "whether the source is damaged or was changed after commit, which `zarrckpt cp --allow-modified` "
                "copies as it is, without a commit record; `zarrckpt gc` removes the uncommitted copy)"
            )
        protocol.commit(target, copy)
    except BaseException:
        markers.abandon(target, save_id)
        raise
    return {
        "src": source.url,
        "dst": target.url,
        "objects": len(objects),
        "bytes": moved,
        "bytes_checked": checked["bytes_read"],
        "tensors": checked["tensors"],
        "seconds": time.perf_counter() - start,
        "recorded": recorded,
    }
