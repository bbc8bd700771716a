"""Verify a stored array: every shard object present and of its committed size, every index entry and
every chunk checksum (compared with the commit record where the manifest has one).

What is there comes from a listing (names and sizes), so the work is bounded by the objects that
exist, whatever the manifest claims: missing objects are counted, not enumerated; an object of the
wrong size is reported with its real length and every inner chunk it lacks, without reading it; only
objects of the right size are read, whole, and each of their chunks checked. What a listing shows
amiss (an object missing, of another size, or one that is no shard) is believed only once a second
listing, of the array's own objects, shows it too: a listing's answer damaged on the way can name
or size an object wrongly and still parse. An object listed as 0 bytes is read (one byte) to tell
one that is no regular file (a FIFO, socket, device: named so) from one cut short.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import numpy as np

from zarrckpt.engine.reader import read_shard
from zarrckpt.errors import CorruptChunkError, ModifiedCheckpointError, StorageError, causes
from zarrckpt.format import integrity
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.layout import Shape, grid_shape
from zarrckpt.format.shard import EMPTY, ShardLayout, decode_index
from zarrckpt.plan.fetch import ShardTask, plan_shard
from zarrckpt.storage.localfs import NotAFileError
from zarrckpt.storage.store import Storage

SHOWN = 8  # names or chunks a message lists before it counts the rest


def verify_array(
    storage: Storage, meta: ArrayMeta, *, any_layout: bool = False, listing: Mapping[str, int] | None = None
) -> int:
    """Check every shard object of ``meta``; returns the bytes read.

    Args:
        listing: the objects of the checkpoint (path relative to it -> size), as
            :meth:`Storage.sizes` gives them; without it the array's own objects are listed.
        any_layout: shards laid out by any Zarr writer (``allow_modified``): sizes are not known
            ahead, so every object there is read by its index.

    Raises:
        CorruptChunkError: naming every problem found: objects missing (counted), of the wrong size
            (with the chunks they lack), or whose index or chunks fail their checks.
        ModifiedCheckpointError: objects that are no shard of the array's grid, a constant array
            holding objects, or a chunk that is not the committed one.
    """
    present, strays = _shard_objects(meta, _own_objects(storage, meta) if listing is None else listing)
    if strays or (present if meta.constant is not None else _amiss(meta, present)):  # news: ask again
        present, strays = _shard_objects(meta, _own_objects(storage, meta))
    at = meta.shards_at
    where = storage.where(at)
    if meta.constant is not None and not any_layout:
        if present or strays:
            raise ModifiedCheckpointError(
                f"{meta.key!r} was committed as a constant array, without chunks, but {where} holds some: "
                f"written after commit by another writer; {integrity.ALLOW_HINT}",
                key=meta.key,
                chunk=at,
            )
        return 0
    problems: list[str] = []
    if strays:
        problems.append(
            f"{len(strays)} object(s) under {where} are no shard of its grid (e.g. {strays[0]!r}): written by "
            "another tool"
        )
    grid = grid_shape(meta.shape, meta.shard_shape)
    missing = math.prod(grid) - len(present)
    if missing and meta.constant is None:  # (with allow_modified, a constant array's chunks are optional)
        names = ", ".join(meta.shard_path(i) for i in _first_missing(grid, present))
        problems.append(f"{missing} of {math.prod(grid)} shard objects of {meta.key!r} are missing: {names}")
    readable = []
    for index, size in sorted(present.items()):
        layout = ShardLayout.of(meta, index)
        if any_layout or size == layout.nbytes or _valid_index(storage, meta, index, layout, size):
            readable.append(index)  # (a valid shard of another size: another tool's layout, which reading tells)
        else:
            problems.append(_wrong_size(storage, meta, index, layout, size))

    def check(index: Shape) -> tuple[int, CorruptChunkError | None]:
        task = ShardTask(meta, index)
        task.needs = {k: [] for k in ShardLayout.of(meta, index).stored}  # its size was checked: they are there
        try:
            return read_shard(storage, task, None if any_layout else plan_shard(task, storage.caps)), None
        except CorruptChunkError as e:
            return 0, e

    results = storage.run_all(check, readable)
    errors = [e for _, e in results if e is not None]
    if errors and not problems and len(errors) == 1:
        raise errors[0]
    problems += [str(e) for e in errors]
    if problems:
        kind = (
            ModifiedCheckpointError if strays or any(isinstance(e, ModifiedCheckpointError) for e in errors) else None
        )
        message = "\n".join(problems[:SHOWN]) + (
            f"\n... and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        )
        raise (kind or CorruptChunkError)(message, key=meta.key, chunk=at)
    return sum(n for n, _ in results)


def by_shards(arrays: list[ArrayMeta]) -> tuple[list[ArrayMeta], list[ArrayMeta]]:
    """``arrays`` split into those of several shard objects (their shards are read side by side: verify
    each alone) and those of one or none (a GET of its ``zarr.json`` and at most one of its shard:
    verify them side by side)."""
    alone = [m for m in arrays if m.constant is None and math.prod(grid_shape(m.shape, m.shard_shape)) > 1]
    chosen = set(map(id, alone))
    return alone, [m for m in arrays if id(m) not in chosen]


def _own_objects(storage: Storage, meta: ArrayMeta) -> dict[str, int]:
    """The array's objects (paths relative to the checkpoint -> sizes), by one listing: of its
    directory (chunk keys ``c.1.0``; the shards' names start with ``c``) or of its ``c/``."""
    at = meta.shards_at
    if meta.separator == ".":
        own = storage.child(at).entries()
        return {f"{at}/{name}": size for name, size in own.items() if size is not None and name[:1] == "c"}
    subtree = storage.child(at).sizes()
    return {f"{at}/{name}" if name else at: size for name, size in subtree.items()}


def _amiss(meta: ArrayMeta, present: Mapping[Shape, int]) -> bool:
    """Whether the listed shard objects of ``meta`` are not all there with their committed sizes."""
    if len(present) < math.prod(grid_shape(meta.shape, meta.shard_shape)):
        return True
    return any(size != ShardLayout.of(meta, index).nbytes for index, size in present.items())


def _shard_objects(meta: ArrayMeta, listing: Mapping[str, int]) -> tuple[dict[Shape, int], list[str]]:
    """The objects of ``listing`` named as the array's shards (``c`` and what follows it and its
    separator): shard index -> size for those in its grid, and the names of the others."""
    grid = grid_shape(meta.shape, meta.shard_shape)
    base, sep = f"{meta.path}/c", meta.separator
    present: dict[Shape, int] = {}
    strays: list[str] = []
    for name, size in listing.items():
        if name != base and not name.startswith(base + sep):
            continue
        parts = name[len(base) + 1 :].split(sep) if name != base else []
        index = tuple(int(p) for p in parts if p.isdigit() and p == str(int(p)))
        if len(index) == len(parts) == len(grid) and all(i < n for i, n in zip(index, grid, strict=True)):
            present[index] = size
        else:
            strays.append(name)
    return present, sorted(strays)


def _first_missing(grid: Shape, present: Mapping[Shape, int]) -> list[Shape]:
    """The first few shard indexes (C order) with no object: stops after SHOWN of them, so it looks at
    most ``len(present) + SHOWN`` indexes, however many the grid claims."""
    out = []
    for index in itertools.product(*(range(n) for n in grid)):
        if index not in present:
            out.append(index)
            if len(out) == SHOWN:
                break
    return out


def _valid_index(storage: Storage, meta: ArrayMeta, index: Shape, layout: ShardLayout, size: int) -> bool:
    """Whether a shard object of an unexpected ``size`` holds a shard laid out otherwise (another tool's
    write): an index that verifies, whose chunks all lie inside the object. One ranged read of the
    index, which fits in the object; False for a truncated object."""
    if size < layout.index_nbytes:
        return False
    path = meta.shard_path(index)
    try:
        entries = decode_index(
            storage.read(path, 0, layout.index_nbytes), layout.n_chunks, storage.where(path), meta.key
        )
    except (CorruptChunkError, FileNotFoundError):
        return False
    written = entries[(entries[:, 0] != EMPTY) | (entries[:, 1] != EMPTY)].astype(object)  # no uint64 overflow
    return all(int(offset) + int(nbytes) <= size for offset, nbytes in written)


def _wrong_size(storage: Storage, meta: ArrayMeta, index: Shape, layout: ShardLayout, size: int) -> str:
    """The problem of a shard object of ``size`` bytes where its layout needs ``layout.nbytes`` (or
    that is no regular file: a FIFO, socket or device, listed as 0 bytes, which a read tells)."""
    where = storage.where(meta.shard_path(index))
    if size == 0:  # (a FIFO, a socket, a device list as 0 bytes)
        try:
            storage.read(meta.shard_path(index), 0, 1)
        except StorageError as e:
            if any(isinstance(c, NotAFileError) for c in causes(e)):
                return f"shard object {where} of {meta.key!r} cannot be read: {e}"
        except FileNotFoundError:
            pass
    if size > layout.nbytes:
        return (
            f"shard object {where} of {meta.key!r} is {size} bytes, {layout.nbytes} expected: not laid out as "
            f"zarrckpt wrote it (another tool's write?); {integrity.ALLOW_HINT}"
        )
    whole = layout.chunks_from(size)  # stored chunks wholly inside the first `size` bytes
    lost = layout.n_stored - whole
    places = range(whole, min(layout.n_stored, whole + SHOWN))
    chunks = [list(int(i) for i in np.unravel_index(j, layout.inside)) if layout.inside else [] for j in places]
    shown = ", ".join(map(str, chunks)) + (f" and {lost - len(chunks)} more" if lost > len(chunks) else "")
    index_note = "" if size >= layout.index_nbytes else "; its shard index is cut short too"
    return (
        f"shard object {where} of {meta.key!r} is truncated: {size} bytes of {layout.nbytes}; {lost} of its "
        f"{layout.n_stored} inner chunks lie past its end: {shown}{index_note}"
    )
