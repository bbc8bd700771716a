"""What a commit records about the data it commits, and the checks reads make against it.

Another Zarr tool can rewrite a checkpoint's chunks or metadata and leave a perfectly valid Zarr
array behind, fresh checksums included, so checksums alone cannot tell such an edit from the
committed data (a zarr-python rewrite of one element even leaves the shard index byte-identical).
So the manifest records, per array (docs/FORMAT.md §6):

- its ``shape``, ``data_type`` and ``meta_crc32c``, a crc32c of what zarrckpt reads it by (key,
  shape, data type, shard and inner-chunk shapes, role, kind, Python type, chunk key separator);
- where its committed chunk checksums are: ``chunk_table``, its segment of the chunk checksum table
  (:data:`TABLE`, one object beside the manifest; format version 3): ``offset`` and ``bytes`` in
  the table and the segment's own ``crc32c``, so a lazy reader fetches and checks only its array's
  part; or, in manifests of versions 1 and 2, ``chunk_crc32c``, the same bytes inline in base64;
  or, for a constant array (no shard objects by design, its value in ``meta_crc32c``),
  ``"constant": true``. The bytes: one little-endian uint32 per inner chunk of every shard (shards
  in C order of the shard grid, chunks in index order within a shard; slots of chunks outside the
  array hold 0). The table's size and crc32c are in ``integrity.table``;

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
from zarrckpt.format.deferred import Deferred
from zarrckpt.format.layout import Shape, flat_index, grid_shape

if TYPE_CHECKING:
    from zarrckpt.format.array import ArrayMeta

ATTRIBUTES_DIGEST = "attributes_crc32c"
RECORD = "integrity"
TABLE = ".zarrckpt-crc32c"  # the chunk checksum table, beside the manifest (format version 3)
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
    shards = per_shard = 1
    for n, shard, chunk in zip(meta.shape, meta.shard_shape, meta.chunk_shape, strict=True):
        shards *= -(-n // shard)
        per_shard *= shard // chunk
    return shards, per_shard


# one encoder for every digest: json.dumps builds a new one per call when given options
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False)


def canonical(doc: Any) -> bytes:
    return _CANONICAL.encode(doc).encode()


def meta_digest(meta: ArrayMeta) -> int:
    """crc32c of :func:`canonical` ``[key, shape, dtype, shard shape, chunk shape, role, kind,
    python_type(, constant hex)(, ".")]``, spelled here as the encoder would (a twentieth of its
    cost). The chunk key separator is there when it is "." (format version 4): one bit from "/",
    which would send every read of the array to other objects."""
    text = _TEXT  # (the encoder's own string escaping; ints as their repr)
    fields = [text(meta.key), _ints(meta.shape), text(meta.dtype), _ints(meta.shard_shape), _ints(meta.chunk_shape)]
    fields += [text(meta.role), text(meta.kind), text(meta.python_type)]
    if meta.constant is not None:  # a constant array: its elements' bytes, as hex
        fields.append(text(meta.constant.hex()))
    if meta.separator != "/":
        fields.append(text(meta.separator))
    return crc32c.crc32c(f"[{','.join(fields)}]".encode())


_TEXT = json.encoder.encode_basestring  # (what _CANONICAL, ensure_ascii=False, spells strings with)


def _ints(values: Shape) -> str:
    return f"[{','.join(map(str, values))}]"


def attributes_digest(attributes: Mapping[str, Any]) -> int:
    """crc32c of a manifest's ``zarrckpt`` attributes, all but the digest itself."""
    return crc32c.crc32c(canonical({k: v for k, v in attributes.items() if k != ATTRIBUTES_DIGEST}))


def to_json(written: Written) -> dict[str, dict[str, str]]:
    return {
        key: {str(n): base64.b64encode(crcs).decode() for n, crcs in shards.items()} for key, shards in written.items()
    }


def records(
    arrays: Mapping[str, ArrayMeta], gathered: Sequence[Mapping[str, Mapping[str, str]] | Written]
) -> tuple[dict[str, Any], bytes]:
    """The manifest's per-array records and the chunk checksum table, from every rank's
    :func:`to_json` of what it wrote (or, from one process, what it wrote as it is): each array's
    slots in key order, its record saying where.

    Raises ZarrckptError when some shard was written by no rank: committing would lose it.
    """
    grids = {key: _slots(meta) for key, meta in arrays.items()}
    tables = {key: bytearray(4 * math.prod(grids[key])) for key, meta in arrays.items() if meta.constant is None}
    seen: dict[str, set[int]] = {key: set() for key in tables}
    for view in gathered:
        for key, shards in view.items():
            per_shard = grids[key][1] * 4  # (a constant array's entry holds no shards)
            for number, encoded in shards.items():
                n = int(number)
                tables[key][n * per_shard : (n + 1) * per_shard] = (
                    encoded if isinstance(encoded, bytes) else base64.b64decode(encoded)
                )
                seen[key].add(n)
    lost = [f"{key} ({grids[key][0] - len(seen[key])} shards)" for key in tables if len(seen[key]) < grids[key][0]]
    if lost:
        raise ZarrckptError(f"not committed: no rank wrote some shards of {', '.join(lost[:10])}; this is a bug")
    out: dict[str, Any] = {}
    table = bytearray()
    for key, meta in sorted(arrays.items()):
        record: dict[str, Any] = {"shape": list(meta.shape), "data_type": meta.dtype, "meta_crc32c": meta_digest(meta)}
        if meta.constant is not None:  # no chunks by design
            record["constant"] = True
        else:
            segment = tables[key]
            record["chunk_table"] = {"offset": len(table), "bytes": len(segment), "crc32c": crc32c.crc32c(segment)}
            table += segment
        out[meta.path] = record
    return out, bytes(table)


def table_ref(table: bytes) -> dict[str, Any]:
    """The manifest's ``integrity.table``: the chunk checksum table's name, size and crc32c."""
    return {"path": TABLE, "bytes": len(table), "crc32c": crc32c.crc32c(table)}


def check_table_ref(found: Any, bad: Any) -> dict[str, Any]:
    """A manifest's ``integrity.table`` (untrusted), checked."""
    if (
        not isinstance(found, dict)
        or found.keys() != {"path", "bytes", "crc32c"}
        or found["path"] != TABLE
        or not _uint(found["bytes"], 4 * MAX_TABLE_SLOTS)
        or not _uint(found["crc32c"], 2**32 - 1)
    ):
        raise bad(
            f"field 'attributes.zarrckpt.integrity.table' must be {{'path': {TABLE!r}, 'bytes': its size, "
            f"'crc32c': its CRC-32C}}, not {str(found)[:200]}"
        )
    return found


MAX_TABLE_SLOTS = 2**32  # a table of 16 GiB: far beyond any checkpoint (5 million slots at 16,384 ranks)


def _uint(value: Any, most: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= most


def compare(
    arrays: dict[str, ArrayMeta], recorded: Any, bad: Any, table: dict[str, Any] | None = None
) -> tuple[dict[str, ArrayMeta], dict[str, str]]:
    """Check the arrays of a manifest against its records.

    Returns the arrays carrying their committed chunk checksums (inline records) or where those are
    in the chunk checksum table whose ``integrity.table`` is ``table``, and ``key -> what changed``
    for every array whose metadata differs from what was committed. ``bad`` makes the error for a
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
        if "chunk_table" in rec:
            out[meta.key] = replace(meta, crc_segment=_segment(path, meta, rec["chunk_table"], table, bad))
            continue
        try:
            found = base64.b64decode(rec.get("chunk_crc32c", ""), validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise bad(f"the chunk checksums recorded for {path!r} are not base64") from None
        if len(found) != 4 * math.prod(_slots(meta)):
            raise bad(f"the chunk checksums recorded for {path!r} do not fit its shard and chunk grid")
        out[meta.key] = replace(meta, committed_crc32c=found)
    return out, modified


def _segment(path: str, meta: ArrayMeta, found: Any, table: dict[str, Any] | None, bad: Any) -> tuple[int, int, int]:
    """An array record's ``chunk_table`` (untrusted), checked against its grid and the table."""
    if table is None:
        raise bad(f"the record of {path!r} points into a chunk checksum table, but 'integrity.table' is missing")
    if (
        not isinstance(found, dict)
        or found.keys() != {"offset", "bytes", "crc32c"}
        or not all(_uint(found[f], table["bytes"]) for f in ("offset", "bytes"))
        or not _uint(found["crc32c"], 2**32 - 1)
    ):
        raise bad(f"the chunk_table of {path!r} must be {{'offset', 'bytes', 'crc32c'}}, not {str(found)[:200]}")
    offset, nbytes = found["offset"], found["bytes"]
    if nbytes != 4 * math.prod(_slots(meta)) or offset % 4 or offset + nbytes > table["bytes"]:
        raise bad(f"the chunk_table of {path!r} does not fit its shard and chunk grid, or the table")
    return offset, nbytes, found["crc32c"]


def attach(
    arrays: dict[str, ArrayMeta], table: bytes, ref: dict[str, Any]
) -> tuple[dict[str, ArrayMeta], dict[str, str]]:
    """The arrays carrying their committed chunk checksums from the chunk checksum ``table`` as read
    (``ref``: the manifest's ``integrity.table``), and ``key -> why`` for each array whose segment
    is not the committed one (the table changed, damaged or missing: then nothing checks its chunks)."""
    whole = table_matches(table, ref)
    out, modified = dict(arrays), {}
    view, why = memoryview(table), _gone(not table and ref["bytes"] > 0)
    for key, meta in arrays.items():
        if meta.crc_segment is None:
            continue
        offset, nbytes, digest = meta.crc_segment
        segment = bytes(view[offset : offset + nbytes])
        if whole or (len(segment) == nbytes and crc32c.crc32c(segment) == digest):
            out[key] = replace(meta, committed_crc32c=segment)
        else:
            modified[key] = f"the committed chunk checksums of {key!r} in {TABLE} {why}"
            out[key] = replace(meta, crc_segment=None)  # (refused as modified; read as it is now, unchecked)
    return out, modified


def table_matches(table: bytes, ref: dict[str, Any]) -> bool:
    """Whether ``table`` is the chunk checksum table ``ref`` (the manifest's ``integrity.table``) records."""
    return len(table) == ref["bytes"] and bool(crc32c.crc32c(table) == ref["crc32c"])


def check_segment(meta: ArrayMeta, segment: bytes) -> bytes:
    """``segment``, read from the table for ``meta``, when it is the committed one; else raise
    ModifiedCheckpointError."""
    assert meta.crc_segment is not None
    _, nbytes, digest = meta.crc_segment
    if len(segment) != nbytes or crc32c.crc32c(segment) != digest:
        why = _gone(not segment and nbytes > 0)
        raise ModifiedCheckpointError(
            f"the committed chunk checksums of {meta.key!r} in {TABLE} {why}; {ALLOW_HINT}",
            key=meta.key,
        )
    return segment


def _gone(missing: bool) -> str:
    if missing:
        return "are missing (the table is gone or empty)"
    return "are not the ones the manifest recorded (the table was changed or damaged after commit)"


def check_chunk(meta: ArrayMeta, index: Shape, k: int, stored: bytes | bytearray | memoryview, where: str) -> None:
    """Raise ModifiedCheckpointError when inner chunk ``k`` of shard ``index`` (whose own crc32c
    already verified) is not the chunk that was committed. No-op without a record."""
    table = meta.committed_crc32c
    if isinstance(table, Deferred):
        table = table.get()
    if not table:
        if meta.crc_segment is not None:  # never silently unchecked
            raise ZarrckptError(
                f"the committed chunk checksums of {meta.key!r} were not read before its chunks (a bug)"
            )
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
    return not any_layout and all(m.constant is not None or m.committed_crc32c or m.crc_segment for m in arrays)


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
