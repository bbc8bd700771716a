"""Copy a committed checkpoint to another location or store, checked end to end: ``zarrckpt cp``.

The copy is a save at the destination and follows the commit protocol (:mod:`zarrckpt.engine.commit`):
a pending marker first, then every object of the source (each read once, written with the store's
upload checks), then every chunk at the destination read back and checked against the source's
commit record, and only then the manifest. A copy that fails or finds a problem never commits: its
leftover is listed as incomplete and ``zarrckpt gc`` collects it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from zarrckpt.checkpoint import Checkpoint
from zarrckpt.display import Progress
from zarrckpt.engine import commit as protocol
from zarrckpt.engine import markers
from zarrckpt.errors import CorruptChunkError, ModifiedCheckpointError, ZarrckptError
from zarrckpt.format.manifest import DELETING, MANIFEST, PENDING
from zarrckpt.storage.store import Storage
from zarrckpt.types import URL

_MARKERS = {MANIFEST, PENDING, DELETING}


def copy_checkpoint(
    src: URL,
    dst: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: bool = False,
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

    Returns:
        ``{"src", "dst", "objects", "bytes", "bytes_checked", "tensors", "seconds"}``.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, InvalidCheckpointError: ``src`` holds no
            committed checkpoint.
        ModifiedCheckpointError: ``src`` was changed after it was committed.
        CheckpointExistsError: ``dst`` holds a checkpoint and ``overwrite`` is False.
        CorruptChunkError: the copy does not verify (the problems are listed); nothing was committed.
        StorageError: a request failed; nothing was committed.
    """
    start = time.perf_counter()
    source, target = Storage(src, storage_options), Storage(dst, dst_storage_options)
    if source.url.rstrip("/") == target.url.rstrip("/") and storage_options == dst_storage_options:
        raise ZarrckptError(f"refusing to copy {source.url!r} onto itself")
    manifest = protocol.read_manifest(source)
    if manifest.modified:
        changed = ", ".join(sorted(k or "(the attributes)" for k in manifest.modified))
        raise ModifiedCheckpointError(f"not copying {source.url!r}: it was changed after commit ({changed})")
    objects = {path: size for path, size in source.sizes().items() if path not in _MARKERS}
    save_id = protocol.prepare(target, overwrite)
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
        copy = dataclasses.replace(manifest, save_id=save_id)
        checked = Checkpoint(target, copy).verify(progress=progress)
        if checked["problems"]:
            shown = "\n  - ".join(checked["problems"][:8])
            raise CorruptChunkError(
                f"the copy of {source.url!r} at {target.url!r} does not verify, so it was not committed "
                f"({len(checked['problems'])} problem(s)):\n  - {shown}\n(`zarrckpt verify {source.url}` tells "
                "whether the source is damaged; `zarrckpt gc` removes the uncommitted copy)"
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
    }
