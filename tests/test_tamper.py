"""Edits by other Zarr tools after commit: caught by default, readable with allow_modified=True.

zarr-python and TensorStore are the oracles: what they write is valid Zarr, so with
``allow_modified=True`` zarrckpt must read exactly what they read back.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.errors import CorruptChunkError, ModifiedCheckpointError, ZarrckptError
from zarrckpt.format import integrity

zarr = pytest.importorskip("zarr")
ts = pytest.importorskip("tensorstore")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(16, 8, generator=g),  # chunk_bytes=128: 4 inner chunks of [4, 8]
            "b": torch.arange(6, dtype=torch.uint8),  # 1-byte types: zarr-python drops their "endian"
            "m": torch.tensor([True, False, True]),
        },
        "step": 7,
    }


def _target() -> dict[str, Any]:
    return {
        "model": {
            "w": torch.zeros(16, 8),
            "b": torch.zeros(6, dtype=torch.uint8),
            "m": torch.zeros(3, dtype=torch.bool),
        },
        "step": 0,
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    url = tmp_path / "ck"
    zarrckpt.save(_state(), url, chunk_bytes=128)
    return url


def _manifest(url: Path) -> dict[str, Any]:
    return json.loads((url / "zarr.json").read_text())


def test_manifest_records_every_chunk(ckpt: Path) -> None:
    found = _manifest(ckpt)["attributes"]["zarrckpt"]["integrity"]
    record, whole = found["arrays"]["model/w"], (ckpt / integrity.TABLE).read_bytes()
    assert found["table"] == {"path": integrity.TABLE, "bytes": len(whole), "crc32c": crc32c.crc32c(whole)}
    at = record["chunk_table"]
    table = whole[at["offset"] : at["offset"] + at["bytes"]]
    assert at["bytes"] == 16 and at["crc32c"] == crc32c.crc32c(table)
    shard = (ckpt / "model/w/c.0.0").read_bytes()
    head = 16 * 4 + 4
    stored = [shard[head + i * (128 + 4) + 128 : head + (i + 1) * (128 + 4)] for i in range(4)]
    assert [table[4 * i : 4 * i + 4] for i in range(4)] == stored  # each chunk's own crc32c, as written
    assert record["shape"] == [16, 8] and record["data_type"] == "float32"


def test_peer_attribute_edits_and_consolidation_keep_it_loadable(ckpt: Path) -> None:
    group = zarr.open_group(str(ckpt), mode="r+")
    group.attrs["note"] = "reviewed"  # zarr-python rewrites the root zarr.json (and drops 1-byte endians)
    sharding = _manifest(ckpt)["consolidated_metadata"]["metadata"]["model/b"]["codecs"][0]
    assert sharding["configuration"]["codecs"][0] == {"name": "bytes"}
    got = _target()
    zarrckpt.load(got, ckpt)
    assert torch.equal(got["model"]["w"], _state()["model"]["w"]) and got["step"] == 7
    with pytest.warns(UserWarning):
        zarr.consolidate_metadata(str(ckpt))
    got = _target()
    zarrckpt.load(got, ckpt)
    assert torch.equal(got["model"]["b"], _state()["model"]["b"]) and torch.equal(
        got["model"]["m"], _state()["model"]["m"]
    )
    assert zarrckpt.open(ckpt).verify().ok


def _assert_refused_then_read_as_peer_reads(url: Path, key: str, peer: np.ndarray, shard: str) -> None:
    target = _target()
    with pytest.raises(ModifiedCheckpointError, match="modified after commit by another writer") as err:
        zarrckpt.load(target, url)
    assert err.value.key == key and shard in (err.value.chunk or "")
    problems = zarrckpt.open(url).verify()["problems"]
    assert len(problems) == 1 and key in problems[0] and "modified after commit" in problems[0]
    with pytest.raises(ModifiedCheckpointError):
        zarrckpt.open(url)[key].read()
    zarrckpt.load(target, url, allow_modified=True)
    np.testing.assert_array_equal(target["model"]["w"].numpy(), peer)
    ckpt = zarrckpt.open(url, allow_modified=True)
    np.testing.assert_array_equal(ckpt[key].numpy(), peer)
    assert ckpt.verify().ok, ckpt.verify()


def test_zarr_python_rewrite_is_caught(ckpt: Path) -> None:
    arr = zarr.open_array(str(ckpt / "model/w"), mode="r+")
    arr[5, 3] = 99.0  # rewrites the shard: same index bytes, a fresh valid crc32c for chunk 1
    _assert_refused_then_read_as_peer_reads(ckpt, "model.w", arr[...], "model/w/c.0.0")


def test_zarr_python_empty_chunk_is_caught(ckpt: Path) -> None:
    arr = zarr.open_array(str(ckpt / "model/w"), mode="r+", config={"write_empty_chunks": False})
    arr[4:8] = 0.0  # an all-fill chunk: zarr-python drops it (an EMPTY index entry)
    index = np.frombuffer((ckpt / "model/w/c.0.0").read_bytes()[: 16 * 4], "<u8").reshape(4, 2)
    assert index[1, 0] == 2**64 - 1  # really EMPTY
    _assert_refused_then_read_as_peer_reads(ckpt, "model.w", arr[...], "model/w/c.0.0")


def test_tensorstore_rewrite_is_caught(ckpt: Path) -> None:
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(ckpt / "model/w")}}
    store = ts.open(spec).result()
    store[0:4, :].write(np.full((4, 8), -1.5, dtype=np.float32)).result()
    _assert_refused_then_read_as_peer_reads(ckpt, "model.w", store.read().result(), "model/w/c.0.0")


def _shard(chunks: list[tuple[int, bytes]], n_chunks: int, gap: int = 0) -> bytes:
    """A valid sharding_indexed object (index at the start) with the given chunks, in the given
    order, ``gap`` junk bytes before each; chunks not listed are EMPTY."""
    head = 16 * n_chunks + 4
    entries = [(2**64 - 1, 2**64 - 1)] * n_chunks
    body = b""
    for k, data in chunks:
        body += b"\xee" * gap
        stored = data + struct.pack("<I", crc32c.crc32c(data))
        entries[k] = (head + len(body), len(stored))
        body += stored
    index = b"".join(struct.pack("<QQ", *e) for e in entries)
    return index + struct.pack("<I", crc32c.crc32c(index)) + body


def test_any_valid_layout_with_allow_modified(ckpt: Path) -> None:
    """Chunks in reverse order with gaps and one EMPTY: refused, then read as zarr-python reads it."""
    w = _state()["model"]["w"].numpy()
    rows = [w[4 * k : 4 * k + 4].tobytes() for k in range(4)]
    (ckpt / "model/w/c.0.0").write_bytes(_shard([(3, rows[3]), (2, rows[2]), (0, rows[0])], 4, gap=7))
    peer = zarr.open_array(str(ckpt / "model/w"), mode="r")[...]
    assert np.array_equal(peer[:4], w[:4]) and np.all(peer[4:8] == 0)
    _assert_refused_then_read_as_peer_reads(ckpt, "model.w", peer, "model/w/c.0.0")


@pytest.mark.parametrize(
    "entry, match",
    [
        ((10_000, 132), r"shorter than its index says: bytes 10000\.\.10132 hold 0 of 132"),
        ((68, 100), "uncompressed chunks of 132"),
    ],
    ids=["beyond-the-object", "wrong-size"],
)
def test_allow_modified_still_checks_bounds_and_sizes(ckpt: Path, entry: tuple[int, int], match: str) -> None:
    path = ckpt / "model/w/c.0.0"
    raw = bytearray(path.read_bytes())
    index = np.frombuffer(bytes(raw[:64]), "<u8").reshape(4, 2).copy()
    index[2] = entry
    raw[:64] = index.tobytes()
    raw[64:68] = struct.pack("<I", crc32c.crc32c(index.tobytes()))
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunkError, match=match):
        zarrckpt.load(_target(), ckpt, allow_modified=True)


def test_allow_modified_still_checks_chunk_checksums(ckpt: Path) -> None:
    path = ckpt / "model/w/c.0.0"
    raw = bytearray(path.read_bytes())
    raw[68 + 5] ^= 0xFF  # a flipped bit in chunk 0
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunkError, match="fails its crc32c") as err:
        zarrckpt.load(_target(), ckpt, allow_modified=True)
    assert not isinstance(err.value, ModifiedCheckpointError)


def test_peer_resize_is_reported(ckpt: Path) -> None:
    arr = zarr.open_array(str(ckpt / "model/w"), mode="r+")
    arr.resize((20, 8))
    problems = zarrckpt.open(ckpt).verify()["problems"]  # the manifest still says [16, 8]
    assert len(problems) == 1 and "model/w/zarr.json was modified after commit" in problems[0]
    assert "shape (16, 8) -> (20, 8)" in problems[0]
    with pytest.warns(UserWarning):
        zarr.consolidate_metadata(str(ckpt))  # now the manifest's copy says [20, 8] too
    with pytest.raises(
        ModifiedCheckpointError, match=r"'model.w' is now \[20, 8\] float32; it was committed as \[16, 8\]"
    ):
        zarrckpt.load({"model": {"w": torch.zeros(20, 8)}}, ckpt, strict=False)


def test_chunk_keys_moved_to_slashes_after_commit_are_refused(ckpt: Path) -> None:
    """A peer's rewrite of an array with chunk keys "c/0/0" (its objects moved to match, valid Zarr
    for every reader): one bit from "c.0.0", the commit record's meta_crc32c tells."""
    from zarrckpt.format.array import ArrayMeta

    (ckpt / "model/w/c/0").mkdir(parents=True)
    (ckpt / "model/w/c.0.0").rename(ckpt / "model/w/c/0/0")
    own, manifest = ckpt / "model/w/zarr.json", ckpt / "zarr.json"
    for path, node in ((own, lambda d: d), (manifest, lambda d: d["consolidated_metadata"]["metadata"]["model/w"])):
        doc = json.loads(path.read_text())
        node(doc)["chunk_key_encoding"]["configuration"]["separator"] = "/"
        path.write_text(json.dumps(doc))
    peer = zarr.open_array(str(ckpt / "model/w"), mode="r")[...]
    assert np.array_equal(peer, _state()["model"]["w"].numpy())  # still the committed values, elsewhere
    meta = ArrayMeta.from_json("model/w", json.loads(own.read_text()))
    assert meta.separator == "/" and meta.shard_path((0, 0)) == "model/w/c/0/0"
    with pytest.raises(ModifiedCheckpointError, match=r"model\.w"):
        zarrckpt.load(_target(), ckpt)
    target = _target()
    zarrckpt.load(target, ckpt, allow_modified=True)  # read as it is now: where its document says
    assert torch.equal(target["model"]["w"], _state()["model"]["w"])


def test_values_edited_through_our_attributes(ckpt: Path) -> None:
    group = zarr.open_group(str(ckpt), mode="r+")
    info = dict(group.attrs["zarrckpt"])
    info["values"] = {**info["values"], "step": 8}
    group.attrs["zarrckpt"] = info
    with pytest.raises(ModifiedCheckpointError, match="attributes"):
        zarrckpt.load(_target(), ckpt)
    with pytest.raises(ModifiedCheckpointError):
        _ = zarrckpt.open(ckpt).metadata
    with pytest.raises(ModifiedCheckpointError):  # the commit record is in those attributes: nothing is trusted
        zarrckpt.open(ckpt)["model.w"].read()
    got = _target()
    zarrckpt.load(got, ckpt, allow_modified=True)
    assert got["step"] == 8


def test_checkpoints_without_a_record_load_only_with_allow_modified(ckpt: Path) -> None:
    """As written before commit records existed, or with the record removed: nothing tells the two
    apart, so nothing is compared with a commit and reading needs allow_modified=True."""
    doc = _manifest(ckpt)
    del doc["attributes"]["zarrckpt"]["integrity"], doc["attributes"]["zarrckpt"]["attributes_crc32c"]
    (ckpt / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(ModifiedCheckpointError, match="has no commit record"):
        zarrckpt.load(_target(), ckpt)
    (problem,) = zarrckpt.open(ckpt).verify()["problems"]
    assert "has no commit record" in problem
    got = _target()
    zarrckpt.load(got, ckpt, allow_modified=True)
    assert torch.equal(got["model"]["w"], _state()["model"]["w"])
    assert zarrckpt.open(ckpt, allow_modified=True).verify().ok  # as it is now: every chunk's own crc32c


def test_a_shard_no_rank_wrote_is_not_committed() -> None:
    from zarrckpt.format.array import ArrayMeta

    meta = ArrayMeta("w", (8,), "float32", (4,), (2,))
    one = integrity.to_json({"w": {0: b"\x01" * 8}})
    with pytest.raises(ZarrckptError, match=r"no rank wrote some shards of w \(1 shards\)"):
        integrity.records({"w": meta}, [one])
    both = integrity.to_json({"w": {1: b"\x02" * 8}})
    records, table = integrity.records({"w": meta}, [one, both])
    assert table == b"\x01" * 8 + b"\x02" * 8
    assert records["w"]["chunk_table"] == {"offset": 0, "bytes": 16, "crc32c": crc32c.crc32c(table)}


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda rec: rec.pop("chunk_table") and rec.update(chunk_crc32c="not base64!"), "not base64"),
        (lambda rec: rec.pop("chunk_table") and rec.update(chunk_crc32c="AAAA"), "do not fit its shard and chunk grid"),
        (lambda rec: rec.pop("chunk_table") and None, "do not fit its shard and chunk grid"),
        (lambda rec: rec.clear() or rec.update(x=1) or None, "is now"),
        (lambda rec: rec.update(chunk_table=[0, 16, 1]), "must be {'offset', 'bytes', 'crc32c'}"),
        (lambda rec: rec["chunk_table"].update(bytes=12), "does not fit its shard and chunk grid"),
        (lambda rec: rec["chunk_table"].update(offset=10**6), "must be {'offset'"),
        (lambda rec: rec["chunk_table"].update(offset=2), "does not fit its shard and chunk grid"),
        (lambda rec: rec["chunk_table"].update(crc32c=-1), "must be {'offset'"),
    ],
    ids=[
        "not-base64",
        "wrong-length",
        "no-checksums",
        "no-shape",
        "table-entry-not-an-object",
        "table-entry-wrong-length",
        "table-entry-past-the-table",
        "table-entry-unaligned",
        "table-entry-bad-crc",
    ],
)
def test_a_malformed_commit_record_is_refused_clearly(ckpt: Path, edit: Any, match: str) -> None:
    """A record that cannot be the one zarrckpt wrote is an error, never a silently skipped check
    (the attributes digest is recomputed, as a careful hand edit would)."""
    doc = _manifest(ckpt)
    info = doc["attributes"]["zarrckpt"]
    edit(info["integrity"]["arrays"]["model/w"])
    info["attributes_crc32c"] = integrity.attributes_digest(info)
    (ckpt / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(ZarrckptError, match=match):
        zarrckpt.load(_target(), ckpt)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda found: found.pop("table"), "'integrity.table' is missing"),
        (lambda found: found["table"].update(path="../elsewhere"), "must be {'path'"),
        (lambda found: found["table"].update(bytes=-4), "must be {'path'"),
        (lambda found: found["table"].update(extra=1), "must be {'path'"),
    ],
    ids=["missing", "another-path", "negative-size", "unknown-field"],
)
def test_a_malformed_table_entry_is_refused_clearly(ckpt: Path, edit: Any, match: str) -> None:
    """The manifest's ``integrity.table`` names the chunk checksum table beside it, nothing else."""
    doc = _manifest(ckpt)
    info = doc["attributes"]["zarrckpt"]
    edit(info["integrity"])
    info["attributes_crc32c"] = integrity.attributes_digest(info)
    (ckpt / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(ZarrckptError, match=match):
        zarrckpt.open(ckpt)
