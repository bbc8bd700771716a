"""Use what a shard read fetched: check an inner chunk (its own crc32c, the commit record) or an index
entry against zarrckpt's layout, and copy the parts of a chunk that requests need into place."""

from __future__ import annotations

import crc32c
import numpy as np

from zarrckpt.errors import CorruptChunkError, ModifiedCheckpointError
from zarrckpt.format import dtypes, integrity
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.shard import EMPTY, ShardLayout, decode_chunk
from zarrckpt.plan.fetch import ShardTask
from zarrckpt.storage.retry import BadRead


def copy_chunk(task: ShardTask, k: int, raw: memoryview, path: str, blob: memoryview) -> None:
    """Verify inner chunk ``k`` (in ``blob``, the bytes of the read) and copy the parts the requests
    need into their destinations. Raises BadRead when it fails its own crc32c."""
    meta = task.meta
    where = chunk_where(task, k, path)
    try:
        data = decode_chunk(raw, meta.chunk_nbytes, meta.key, where)
    except CorruptChunkError as e:
        raise BadRead(e, crc32c.crc32c(blob), (k,)) from None
    integrity.check_chunk(meta, task.index, k, raw[-4:], where)
    scatter(task, k, np.frombuffer(data, dtype=dtypes.storage_dtype(meta.dtype)).reshape(meta.chunk_shape))


def fill_value(meta: ArrayMeta) -> np.ndarray:
    """One element of ``meta``'s fill value (0-d, the stored dtype): its constant, else zero bits."""
    dtype = dtypes.storage_dtype(meta.dtype)
    bits = bytes(dtype.itemsize) if meta.constant is None else meta.constant
    return np.frombuffer(bits, dtype=dtype).reshape(())


def fill_task(task: ShardTask) -> None:
    for parts in task.needs.values():
        for part, req in parts:
            req.dest[part.relative_to(req.box.offsets).slices()] = fill_value(task.meta)


def chunk_where(task: ShardTask, k: int, path: str) -> str:
    cidx, _ = task.chunk_origin(k)
    return f"{path} (inner chunk {list(cidx)})"


def scatter(task: ShardTask, k: int, chunk: np.ndarray) -> None:
    """Copy the parts of inner chunk ``k`` (its elements, ``chunk``) that requests need into place."""
    _, origin = task.chunk_origin(k)
    for part, req in task.needs[k]:
        req.dest[part.relative_to(req.box.offsets).slices()] = chunk[part.relative_to(origin).slices()]


def check_entry(entry: np.ndarray, layout: ShardLayout, meta: ArrayMeta, path: str, k: int) -> None:
    """Check the index entry of inner chunk ``k`` against zarrckpt's shard layout."""
    offset, nbytes = int(entry[0]), int(entry[1])
    if offset == EMPTY or nbytes != layout.chunk_nbytes:
        state = "is missing from" if offset == EMPTY else f"has a wrong size ({nbytes} bytes) in"
    elif offset != layout.offset(k):
        state = f"is stored at offset {offset}, not {layout.offset(k)}, in"
    else:
        return
    # the index passed its crc32c: someone wrote this layout on purpose
    raise ModifiedCheckpointError(
        f"inner chunk {k} of {meta.key!r} {state} shard {path}: the shard is not laid out as zarrckpt wrote it, "
        f"so it was modified after commit by another writer; {integrity.ALLOW_HINT}",
        key=meta.key,
        chunk=f"{path}#{k}",
    )
