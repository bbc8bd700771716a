"""What a commit records about the data it commits, and the checks reads make against it.

Another Zarr tool can rewrite a checkpoint's chunks or metadata and leave a perfectly valid Zarr
array behind, fresh checksums included, so checksums alone cannot tell such an edit from the
committed data (a zarr-python rewrite of one element even leaves the shard index byte-identical).
So the manifest records, per array (docs/FORMAT.md §6):

- its ``shape``, ``data_type`` and ``meta_crc32c``, a crc32c of what zarrckpt reads it by (key,
  shape, data type, shard and inner-chunk shapes, role, kind, Python type);
- ``chunk_crc32c``: the crc32c of every inner chunk as written, one little-endian uint32 slot
  per inner chunk of every shard (shards in C order of the shard grid, chunks in index order
  within a shard; slots of chunks outside the array hold 0), base64-encoded; or, for a constant
  array (no shard objects by design, its value in ``meta_crc32c``), ``"constant": true``;

and ``attributes_crc32c``, a crc32c of its own ``zarrckpt`` attributes (the saved values with them).
A read compares each chunk's stored crc32c with the committed one; any difference raises
:class:`ModifiedCheckpointError` naming tensor and shard. ``allow_modified=True`` reads the
checkpoint as it is now, through a decoder that accepts every valid shard layout.

A manifest without ``integrity`` or without ``attributes_crc32c`` is *unrecorded* (:class:`Unrecorded`):
written before zarrckpt recorded commits, or with the record removed, which nothing tells apart (the
format version can be edited too). Nothing of it can be compared with what was committed, so reading
it needs ``allow_modified=True`` as a modified checkpoint does.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import crc32c

from zarrckpt.errors import ModifiedCheckpointError, ZarrckptError
from zarrckpt.format.layout import Shape, flat_index, grid_shape
from zarrckpt.format.shard import chunks_per_shard

if TYPE_CHECKING:
    from zarrckpt.format.array import ArrayMeta

ATTRIBUTES_DIGEST = "attributes_crc32c"
RECORD = "integrity"
ALLOW_HINT = "pass allow_modified=True to open or load it as it is now"
UNRECORDED_HINT = (
    "to read it unchecked, as it is now, pass allow_modified=True to zarrckpt.open or zarrckpt.load "
    "(ZarrReader(allow_modified=True) under DCP; `zarrckpt cp --allow-modified` copies it, unrecorded)"
)
# key -> shard number (C order of the shard grid) -> its chunk_crcs() slots
Written = dict[str, dict[int, bytes]]


class Unrecorded(str):
    """Why a manifest has no commit record: its ``modified`` entry under ``""`` (which every read
    counts), told apart from an edit found by the record."""

    @classmethod
    def of(cls, where: str, missing: Sequence[str]) -> Unrecorded:
        fields = " and no ".join(repr(m) for m in missing)
        return cls(
            f"checkpoint manifest {where} has no commit record (no {fields} in attributes.zarrckpt), so its values "
            "and chunk bytes cannot be compared with what was committed: it was written before zarrckpt recorded "
            "commits (2026-12-01), the record was removed after commit, or it is a copy made without one "
            "(`zarrckpt cp --allow-modified`)"
        )


def unrecorded(modified: Mapping[str, str]) -> Unrecorded | None:
    """The reason the manifest whose ``modified`` this is has no commit record; None when it has one."""
    why = modified.get("")
    return why if isinstance(why, Unrecorded) else None


def recorded_changes(modified: Mapping[str, str]) -> dict[str, str]:
    """``modified`` less the missing record: the edits the record found."""
    return {k: why for k, why in modified.items() if not isinstance(why, Unrecorded)}


def shard_number(meta: ArrayMeta, index: Shape) -> int:
    grid = grid_shape(meta.shape, meta.shard_shape)
    return flat_index(index, grid)


def _slots(meta: ArrayMeta) -> tuple[int, int]:
    """(shards, inner chunks per shard) of an array."""
    return math.prod(grid_shape(meta.shape, meta.shard_shape)), math.prod(
        chunks_per_shard(meta.shard_shape, meta.chunk_shape)
    )


# one encoder for every digest: json.dumps builds a new one per call when given options
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False)


def canonical(doc: Any) -> bytes:
    return _CANONICAL.encode(doc).encode()


def meta_digest(meta: ArrayMeta) -> int:
    fields = [meta.key, list(meta.shape), meta.dtype, list(meta.shard_shape), list(meta.chunk_shape)]
    fields += [meta.role, meta.kind, meta.python_type]
    if meta.constant is not None:  # a constant array: its elements' bytes, as hex
        fields.append(meta.constant.hex())
    return crc32c.crc32c(canonical(fields))


def attributes_digest(attributes: Mapping[str, Any]) -> int:
    """crc32c of a manifest's ``zarrckpt`` attributes, all but the digest itself."""
    return crc32c.crc32c(canonical({k: v for k, v in attributes.items() if k != ATTRIBUTES_DIGEST}))


def to_json(written: Written) -> dict[str, dict[str, str]]:
    return {
        key: {str(n): base64.b64encode(crcs).decode() for n, crcs in shards.items()} for key, shards in written.items()
    }


def records(arrays: Mapping[str, ArrayMeta], gathered: Sequence[Mapping[str, Mapping[str, str]]]) -> dict[str, Any]:
    """The manifest's per-array records from every rank's :func:`to_json` of what it wrote.

    Raises ZarrckptError when some shard was written by no rank: committing would lose it.
    """
    tables = {key: bytearray(4 * math.prod(_slots(meta))) for key, meta in arrays.items() if meta.constant is None}
    seen: dict[str, set[int]] = {key: set() for key in tables}
    for view in gathered:
        for key, shards in view.items():
            per_shard = _slots(arrays[key])[1] * 4
            for number, encoded in shards.items():
                n = int(number)
                tables[key][n * per_shard : (n + 1) * per_shard] = base64.b64decode(encoded)
                seen[key].add(n)
    lost = [
        f"{key} ({_slots(arrays[key])[0] - len(seen[key])} shards)"
        for key in tables
        if len(seen[key]) < _slots(arrays[key])[0]
    ]
    if lost:
        raise ZarrckptError(f"not committed: no rank wrote some shards of {', '.join(lost[:10])}; this is a bug")
    return {
        meta.path: {
            "shape": list(meta.shape),
            "data_type": meta.dtype,
            "meta_crc32c": meta_digest(meta),
            **(
                {"constant": True}  # no chunks by design
                if meta.constant is not None
                else {"chunk_crc32c": base64.b64encode(tables[key]).decode()}
            ),
        }
        for key, meta in sorted(arrays.items())
    }


def compare(arrays: dict[str, ArrayMeta], recorded: Any, bad: Any) -> tuple[dict[str, ArrayMeta], dict[str, str]]:
    """Check the arrays of a manifest against its records.

    Returns the arrays carrying their committed chunk checksums, and ``key -> what changed`` for
    every array whose metadata differs from what was committed. ``bad`` makes the error for a
    malformed record.
    """
    if not isinstance(recorded, dict):
        raise bad(f"field 'attributes.zarrckpt.integrity.arrays' must be an object, not {type(recorded).__name__}")
    modified: dict[str, str] = {}
    out = dict(arrays)
    by_path = {meta.path: meta for meta in arrays.values()}
    for path in sorted(recorded.keys() - by_path.keys()):
        modified[path.replace("/", ".")] = f"array {path!r} was committed but is gone from the metadata"
    for path, meta in by_path.items():
        rec = recorded.get(path)
        if rec is None:
            modified[meta.key] = (
                f"array {path!r} has no entry in the commit record: added after commit, or its entry was removed"
            )
            continue
        if not isinstance(rec, dict):
            raise bad(f"the integrity record of {path!r} must be an object")
        if rec.get("shape") != list(meta.shape) or rec.get("data_type") != meta.dtype:
            modified[meta.key] = (
                f"{meta.key!r} is now {list(meta.shape)} {meta.dtype}; it was committed as "
                f"{rec.get('shape')} {rec.get('data_type')}"
            )
            continue
        if rec.get("meta_crc32c") != meta_digest(meta) or (rec.get("constant") is True) != (meta.constant is not None):
            modified[meta.key] = (
                f"the metadata of {meta.key!r} (chunking, role, kind or constant value) is not what was committed"
            )
            continue
        if meta.constant is not None:  # no chunks, so no chunk checksums
            continue
        try:
            table = base64.b64decode(rec.get("chunk_crc32c", ""), validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise bad(f"the chunk checksums recorded for {path!r} are not base64") from None
        if len(table) != 4 * math.prod(_slots(meta)):
            raise bad(f"the chunk checksums recorded for {path!r} do not fit its shard and chunk grid")
        out[meta.key] = replace(meta, committed_crc32c=table)
    return out, modified


def check_chunk(meta: ArrayMeta, index: Shape, k: int, stored: bytes | bytearray | memoryview, where: str) -> None:
    """Raise ModifiedCheckpointError when inner chunk ``k`` of shard ``index`` (whose own crc32c
    already verified) is not the chunk that was committed. No-op without a record."""
    table = meta.committed_crc32c
    if not table:
        return
    at = 4 * (shard_number(meta, index) * _slots(meta)[1] + k)
    if bytes(stored) != table[at : at + 4]:
        raise ModifiedCheckpointError(
            f"chunk {where} of {meta.key!r} was modified after commit by another writer: its crc32c is "
            f"{bytes(stored)[::-1].hex()}, the commit recorded {table[at : at + 4][::-1].hex()}; {ALLOW_HINT}",
            key=meta.key,
            chunk=where,
        )


def reads_are_checked(arrays: Sequence[ArrayMeta], any_layout: bool) -> bool:
    """Whether every chunk a read of ``arrays`` uses is compared with the commit record.

    Then a read that returns holds the committed values of the manifest it began with, even when
    a save replaced the checkpoint meanwhile (a replaced chunk fails the comparison, unless its
    bytes are the committed ones), so re-reading the manifest at the end adds nothing. Not so with
    ``any_layout`` (``allow_modified``) or for a checkpoint committed without the record.
    """
    return not any_layout and all(m.constant is not None or m.committed_crc32c for m in arrays)


def refuse_modified(modified: Mapping[str, str], keys: Sequence[str] | None, url: str) -> None:
    """Raise ModifiedCheckpointError for what changed since commit among ``keys`` (all when None);
    the key ``""`` (the attributes, values with them; or no commit record at all) always counts."""
    missing = unrecorded(modified)
    if missing is not None:
        raise ModifiedCheckpointError(f"{missing}; {UNRECORDED_HINT}", key="")
    found = {k: why for k, why in modified.items() if k == "" or keys is None or k in keys}
    if found:
        lines = [found[k] for k in sorted(found)]
        raise ModifiedCheckpointError(
            f"the checkpoint at {url!r} was modified after commit by another writer:\n  "
            + "\n  ".join(lines[:20])
            + ("" if len(lines) <= 20 else f"\n  ... and {len(lines) - 20} more")
            + f"\n{ALLOW_HINT}",
            key=min(found),
        )
