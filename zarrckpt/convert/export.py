"""Export a checkpoint's tensors as Hugging Face-style (sharded) safetensors files, streamed.

The safetensors format is written here directly: an 8-byte little-endian header length, a JSON
header (``dtype``, ``shape``, ``data_offsets`` per tensor, padded with spaces to 8 bytes), then
the raw little-endian tensor bytes. Each tensor is read in blocks of at most ``block_bytes``
through the lazy :class:`~zarrckpt.TensorView` slicing API and appended to the file, so memory
stays bounded (two blocks: one being written, one being read ahead) whatever the tensor or
checkpoint size.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import re
import struct
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from zarrckpt.checkpoint import Checkpoint
from zarrckpt.checkpoint import open as open_checkpoint
from zarrckpt.display import Progress
from zarrckpt.engine import commit as protocol
from zarrckpt.errors import UnsupportedValueError, ZarrckptError
from zarrckpt.format import dtypes, integrity
from zarrckpt.format.keys import ROLES
from zarrckpt.tensorview import TensorView
from zarrckpt.types import URL, Role

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_NAME",
    "ROLES",
    "SAFETENSORS_DTYPES",
    "export_safetensors",
    "parse_dtype",
    "parse_size",
]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # "5GB", as in transformers' save_pretrained
DEFAULT_BLOCK_BYTES = 64 << 20
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_SHARD_NAME = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")

# torch dtype <-> safetensors dtype name, from the one dtype table (complex128: safetensors has none)
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    dtypes.torch_dtype(name): st
    for name in dtypes.SUPPORTED
    if (st := dtypes.safetensors_name(dtypes.torch_dtype(name)))
}
_CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, ``123`` -> 123 (decimal units, as HF)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value: float = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ZarrckptError(f"bad size {text!r}: use a number of bytes or e.g. '500MB', '5GB', '2GiB'")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 1:
        raise ZarrckptError(f"bad size {text!r}: must be at least 1 byte")
    return int(value)


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"`` / ``"fp16"`` / ``"fp32"`` (or ``"bfloat16"``, ``torch.bfloat16``, ...) -> torch dtype."""
    if dtype is None:
        return None
    name = str(dtype).lower().removeprefix("torch.")
    found = _CASTS.get(name, getattr(torch, name, None) if name.isidentifier() else None)
    if found not in _CASTS.values():
        raise ZarrckptError(f"cannot export as dtype {dtype!r}: choose bf16, fp16 or fp32")
    return found


@dataclass(frozen=True)
class _Item:
    name: str  # tensor name in the export
    view: TensorView
    dtype: torch.dtype  # dtype written

    @property
    def nbytes(self) -> int:
        return math.prod(self.view.shape) * self.dtype.itemsize


def export_safetensors(
    url_or_checkpoint: URL | Checkpoint,
    out_dir: str | os.PathLike[str],
    *,
    roles: Iterable[Role | str] | None = None,
    dtype: str | torch.dtype | None = None,
    include: str | Sequence[str] | None = None,
    max_shard_bytes: int | str = DEFAULT_MAX_SHARD_BYTES,
    strip_prefix: str | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: bool = False,
    overwrite: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> dict[str, Any]:
    """Write the checkpoint's tensors to ``out_dir`` as Hugging Face-style safetensors.

    One ``model.safetensors`` when everything fits in ``max_shard_bytes``; otherwise
    ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``
    (``{"metadata": {"total_size"}, "weight_map": {name: file}}``). A tensor larger than
    ``max_shard_bytes`` gets a file of its own. Tensors are streamed in blocks of at most
    ``block_bytes``, so memory stays bounded whatever their size. Files are written under
    temporary names and renamed into place at the end (the index last). Non-tensor values
    (step, config) are not exported.

    Args:
        url_or_checkpoint: the checkpoint: a URL (opened with :func:`zarrckpt.open`) or an open
            :class:`~zarrckpt.Checkpoint`.
        out_dir: a local directory (or ``file://`` URL); it must be empty or absent unless
            ``overwrite``.
        roles: keep only tensors of these roles (:class:`~zarrckpt.types.Role` members or their
            names: ``main_weight``, ``first_moment``, ``second_moment``, ``optimizer_step``,
            ``buffer``, ``other``).
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (or the torch dtype): cast floating-point
            tensors to it; integer and bool tensors are written as they are.
        include: keep only keys matching one of these fnmatch patterns.
        max_shard_bytes: the largest file, in bytes or as ``"5GB"``, ``"500MiB"``.
        strip_prefix: remove this leading prefix (``"model."``) from tensor names.
        storage_options: passed to fsspec when ``url_or_checkpoint`` is a URL.
        progress: draw a progress bar on stderr.
        overwrite: replace the safetensors files of an earlier export in ``out_dir``.
        block_bytes: the most bytes read from the checkpoint at a time, per tensor.

    Returns:
        A summary: ``{"source", "out", "files", "index", "tensors", "bytes", "dtype",
        "seconds"}`` (``index`` is None for a single file, ``dtype`` None without a cast).

    Raises:
        ZarrckptError: an unknown role, dtype or size; no tensor left to export; two keys that
            become one name after ``strip_prefix``; ``out_dir`` not empty (without
            ``overwrite``), not a local directory, or not creatable.
        UnsupportedValueError: a selected tensor's dtype has no safetensors equivalent (leave it
            out with ``include`` or ``roles``).
        IncompleteCheckpointError: the checkpoint was overwritten or deleted during the export
            (nothing is published), or ``url_or_checkpoint`` holds no committed checkpoint.
        CorruptChunkError: a chunk read fails its checksum or is missing
            (``ModifiedCheckpointError``: it changed after commit).
        ModifiedCheckpointError: before anything is written, the selected tensors changed after
            commit, or the checkpoint has no commit record; to export it as it is now, pass
            ``zarrckpt.open(url, allow_modified=True)``.
        CheckpointNotFoundError, InvalidCheckpointError, StorageError: as for :func:`zarrckpt.open`.
    """
    start = time.perf_counter()
    ckpt = (
        url_or_checkpoint
        if isinstance(url_or_checkpoint, Checkpoint)
        else open_checkpoint(url_or_checkpoint, storage_options=storage_options)
    )
    # every chunk exported is read whole and verified, against checksums from one read of the table
    ckpt = dataclasses.replace(ckpt.with_chunk_checksums(), partial_reads=False)
    cast = parse_dtype(dtype)
    limit = parse_size(max_shard_bytes)
    if block_bytes < 1:
        raise ZarrckptError(f"block_bytes must be positive, got {block_bytes}")
    items = _select(ckpt, roles, include, cast, strip_prefix)
    # before anything is written: a checkpoint changed after commit, or without a commit record, is
    # exported only when opened with allow_modified=True (then passed in as a Checkpoint)
    integrity.refuse_modified(ckpt.manifest.modified, [it.view.key for it in items], ckpt.storage.url)
    out = _prepare_out(out_dir, overwrite)
    shards = _plan_shards(items, limit)
    names = (
        [SINGLE_NAME]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    total = sum(it.nbytes for it in items)
    bar = Progress("export", len(items), total) if progress else None
    files = {out / name: shard for name, shard in zip(names, shards, strict=True)}
    written: list[Path] = []
    try:
        for path, shard in files.items():
            written.append(_write_file(_partial(path), shard, block_bytes, bar))
        if len(shards) > 1:
            weight_map = {it.name: path.name for path, shard in files.items() for it in shard}
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            written.append(_partial(out / INDEX_NAME))
            written[-1].write_bytes((json.dumps(index, indent=2) + "\n").encode())
        protocol.check_unchanged(ckpt.storage, ckpt.manifest.save_id)  # never publish a mix of two saves
        for tmp in written:  # the index last: a reader that finds it finds every shard
            os.replace(tmp, tmp.with_name(tmp.name.removeprefix(".").removesuffix(".partial")))
    finally:
        for tmp in written:
            tmp.unlink(missing_ok=True)
        for path in files:
            _partial(path).unlink(missing_ok=True)
    _remove_stale(out, set(names) | ({INDEX_NAME} if len(shards) > 1 else set()))
    if bar:
        bar.finish()
    return {
        "source": ckpt.storage.url,
        "out": str(out),
        "files": names,
        "index": INDEX_NAME if len(shards) > 1 else None,
        "tensors": len(items),
        "bytes": total,
        "dtype": str(cast).removeprefix("torch.") if cast else None,
        "seconds": time.perf_counter() - start,
    }


def _select(
    ckpt: Checkpoint,
    roles: Iterable[Role | str] | None,
    include: str | Sequence[str] | None,
    cast: torch.dtype | None,
    strip_prefix: str | None,
) -> list[_Item]:
    wanted = None if roles is None else {r.value if isinstance(r, Role) else r for r in roles}
    if wanted is not None:
        unknown = sorted(wanted - set(ROLES))
        if unknown or not wanted:
            raise ZarrckptError(
                f"unknown role(s) {', '.join(map(repr, unknown)) or '(none given)'}; roles are: {', '.join(ROLES)}"
            )
    patterns = [include] if isinstance(include, str) else list(include or [])
    items: list[_Item] = []
    seen: dict[str, str] = {}
    for key in ckpt:
        view = ckpt[key]
        if wanted is not None and view.role not in wanted:
            continue
        if patterns and not any(fnmatch.fnmatchcase(key, p) for p in patterns):
            continue
        name = key.removeprefix(strip_prefix) if strip_prefix else key
        if not name:
            raise ZarrckptError(f"--strip-prefix {strip_prefix!r} leaves the key {key!r} empty")
        if name in seen:
            raise ZarrckptError(
                f"keys {seen[name]!r} and {key!r} both become {name!r} after stripping {strip_prefix!r}"
            )
        seen[name] = key
        out_dtype = cast if cast is not None and view.dtype.is_floating_point else view.dtype
        if out_dtype not in SAFETENSORS_DTYPES:
            raise UnsupportedValueError(
                f"{key!r} is {str(out_dtype).removeprefix('torch.')}, which safetensors cannot hold; "
                f"leave it out with include= or roles= (safetensors dtypes: {', '.join(SAFETENSORS_DTYPES.values())})"
            )
        items.append(_Item(name, view, out_dtype))
    if not items:
        filters = [f"roles {sorted(wanted)}" if wanted is not None else "", f"include {patterns}" if patterns else ""]
        raise ZarrckptError(
            f"no tensors to export from {ckpt.storage.url!r}"
            + (f" with {' and '.join(f for f in filters if f)}" if any(filters) else "")
            + "; list them with `zarrckpt ls URL`"
        )
    return items


def _prepare_out(out_dir: str | os.PathLike[str], overwrite: bool) -> Path:
    text = os.fspath(out_dir)
    if "://" in text and not text.startswith("file://"):
        raise ZarrckptError(f"export writes to a local directory, not {text!r}; export locally, then upload")
    out = Path(text.removeprefix("file://"))
    if out.exists() and not out.is_dir():
        raise ZarrckptError(f"output {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ZarrckptError(
            f"output directory {str(out)!r} is not empty; choose an empty directory, or pass overwrite=True "
            "(--overwrite) to replace an earlier export there"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ZarrckptError(f"cannot create output directory {str(out)!r}: {e}") from e
    return out


def _plan_shards(items: list[_Item], limit: int) -> list[list[_Item]]:
    """Greedy in key order: a new file when the next tensor would push this one past ``limit``."""
    shards: list[list[_Item]] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.nbytes
    return shards


def _header(items: list[_Item]) -> bytes:
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for it in items:
        doc[it.name] = {
            "dtype": SAFETENSORS_DTYPES[it.dtype],
            "shape": list(it.view.shape),
            "data_offsets": [offset, offset + it.nbytes],
        }
        offset += it.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _partial(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def _write_file(path: Path, shard: list[_Item], block_bytes: int, bar: Progress | None) -> Path:
    # widest elements first, so that every tensor starts aligned to its element size
    ordered = sorted(shard, key=lambda it: (-it.dtype.itemsize, it.name))
    with path.open("wb") as f:
        f.write(_header(ordered))
        for it in ordered:
            written = _copy_tensor(f, it, block_bytes, bar)
            if written != it.nbytes:  # never write a file whose header does not match its data
                raise ZarrckptError(f"{it.view.key!r}: wrote {written} bytes, expected {it.nbytes}")
            if bar:
                bar.advance(items=1)
        f.flush()
        os.fsync(f.fileno())
    return path


def _blocks(shape: tuple[int, ...], itemsize: int, block_bytes: int, chunk: Sequence[int]) -> Iterator[Any]:
    """Indexes that cut a C-ordered tensor into consecutive pieces of at most ``block_bytes``.

    Leading dimensions are taken one index at a time until the trailing ones fit; the last
    split dimension is sliced in steps (aligned to the inner-chunk grid when that fits).
    """
    if not shape or math.prod(shape) == 0:
        yield ...
        return
    tail = itemsize
    split = len(shape)  # dims [split:] fit whole in a block
    while split > 0 and tail * shape[split - 1] <= block_bytes:
        split -= 1
        tail *= shape[split]
    if split == 0:
        yield ...
        return
    d = split - 1
    step = max(1, block_bytes // tail)
    if d < len(chunk) and chunk[d] <= step:
        step -= step % chunk[d]
    for lead in np.ndindex(*shape[:d]):
        for lo in range(0, shape[d], step):
            yield (*lead, slice(lo, min(lo + step, shape[d])))


def _copy_tensor(f: BinaryIO, it: _Item, block_bytes: int, bar: Progress | None) -> int:
    """Append one tensor's bytes to ``f``, reading a block ahead while writing the current one."""
    chunk = it.view.meta.chunk_shape
    indexes = _blocks(it.view.shape, max(it.view.dtype.itemsize, it.dtype.itemsize), block_bytes, chunk)
    written = 0
    with ThreadPoolExecutor(1, thread_name_prefix="zarrckpt-export") as pool:
        pending: Future[torch.Tensor] | None = pool.submit(it.view.__getitem__, next(indexes))
        while pending is not None:
            block = pending.result()
            nxt = next(indexes, None)
            pending = pool.submit(it.view.__getitem__, nxt) if nxt is not None else None
            data = _le_bytes(block.to(it.dtype) if block.dtype != it.dtype else block)
            f.write(data.data)
            written += data.nbytes
            if bar:
                bar.advance(nbytes=data.nbytes)
            del block, data
    return written


def _le_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's elements as little-endian bytes (a flat uint8 array, no copy on little-endian hosts)."""
    arr = dtypes.as_numpy(t.contiguous())
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and sys.byteorder == "big"):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def _remove_stale(out: Path, keep: set[str]) -> None:
    """Drop safetensors files of an earlier export that this one did not rewrite (``overwrite``)."""
    for p in out.iterdir():
        if p.name not in keep and (p.name == INDEX_NAME or _SHARD_NAME.match(p.name)):
            p.unlink()
