"""The chunk checksum table (docs/FORMAT.md §6, format version 3): written beside the manifest,
read once per load, one array's segment per lazy read; a table changed, damaged or gone is caught
for the arrays it no longer backs, never read past silently."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import zarrckpt
from zarrckpt.engine import crctable
from zarrckpt.format import integrity
from zarrckpt.format.manifest import Manifest
from zarrckpt.storage.store import Storage
from zarrckpt.testing import RequestLog


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(64, 32, generator=g), "b": torch.randn(48, generator=g), "c": torch.zeros(5), "step": 4}


def _target() -> dict[str, Any]:
    return {"a": torch.empty(64, 32), "b": torch.empty(48), "c": torch.ones(5), "step": 0}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    url = tmp_path / "ck"
    zarrckpt.save(_state(), str(url), chunk_bytes=1024)
    return url


def _record(url: Path) -> dict[str, Any]:
    found: dict[str, Any] = json.loads((url / "zarr.json").read_bytes())["attributes"]["zarrckpt"]
    return found


def test_a_save_writes_the_table_and_a_version_4_manifest(ckpt: Path) -> None:
    info = _record(ckpt)
    table = (ckpt / integrity.TABLE).read_bytes()
    assert info["format_version"] == 4  # (the table: 3; chunk keys "c.0": 4)
    assert info["integrity"]["table"] == {"path": integrity.TABLE, "bytes": len(table), "crc32c": crc32c.crc32c(table)}
    arrays = info["integrity"]["arrays"]
    assert arrays["c"] == {
        "shape": [5],
        "data_type": "float32",
        "meta_crc32c": arrays["c"]["meta_crc32c"],
        "constant": True,
    }
    segments = [arrays[k]["chunk_table"] for k in ("a", "b")]  # in key order, back to back, nothing else
    assert [s["offset"] for s in segments] == [0, segments[0]["bytes"]] and sum(s["bytes"] for s in segments) == len(
        table
    )
    for s in segments:
        assert s["crc32c"] == crc32c.crc32c(table[s["offset"] : s["offset"] + s["bytes"]])
    assert all("chunk_crc32c" not in r for r in arrays.values())  # nothing of it inline any more
    got = _target()
    zarrckpt.load(got, str(ckpt))
    assert all(torch.equal(got[k], _state()[k]) for k in "abc") and got["step"] == 4


def test_a_missing_table_refuses_what_it_backed(ckpt: Path) -> None:
    (ckpt / integrity.TABLE).unlink()
    with pytest.raises(zarrckpt.ModifiedCheckpointError, match=r"'a' in \.zarrckpt-crc32c are missing"):
        zarrckpt.load(_target(), str(ckpt))
    with pytest.raises(zarrckpt.ModifiedCheckpointError, match="are missing"):
        zarrckpt.open(str(ckpt))["b"][:4]
    got = _target()
    zarrckpt.load(got, str(ckpt), keys=["c", "step"])  # a constant array and the values need no table
    assert torch.equal(got["c"], torch.zeros(5)) and got["step"] == 4
    problems = zarrckpt.open(str(ckpt)).verify()["problems"]
    assert len(problems) == 2 and all("are missing" in p for p in problems)
    got = _target()
    zarrckpt.load(got, str(ckpt), allow_modified=True)  # as it is now: every chunk's own crc32c
    assert torch.equal(got["a"], _state()["a"])


def test_a_changed_segment_refuses_its_array_only(ckpt: Path) -> None:
    arrays = _record(ckpt)["integrity"]["arrays"]
    at = arrays["b"]["chunk_table"]["offset"]
    path = ckpt / integrity.TABLE
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(zarrckpt.ModifiedCheckpointError, match=r"'b' in \.zarrckpt-crc32c are not the ones"):
        zarrckpt.load(_target(), str(ckpt))
    got = _target()
    zarrckpt.load(got, str(ckpt), keys=["a"])
    assert torch.equal(got["a"], _state()["a"])
    view = zarrckpt.open(str(ckpt))
    assert torch.equal(view["a"][3:9], _state()["a"][3:9])
    with pytest.raises(zarrckpt.ModifiedCheckpointError, match="are not the ones"):
        view["b"][:4]
    (problem,) = view.verify()["problems"]
    assert "'b'" in problem


def test_a_stale_table_of_another_save_is_caught(tmp_path: Path, ckpt: Path) -> None:
    """The same keys and shapes, other values: the other save's table fits, and is refused."""
    other = tmp_path / "other"
    state = _state()
    state["a"] = state["a"] + 1
    zarrckpt.save(state, str(other), chunk_bytes=1024)
    (ckpt / integrity.TABLE).write_bytes((other / integrity.TABLE).read_bytes())
    with pytest.raises(zarrckpt.ModifiedCheckpointError, match="'a' in"):
        zarrckpt.load(_target(), str(ckpt))


def test_a_table_damaged_on_the_way_is_read_again(ckpt: Path) -> None:
    storage = Storage(str(ckpt))
    manifest = Manifest.loads((ckpt / "zarr.json").read_bytes(), "here")
    good = (ckpt / integrity.TABLE).read_bytes()
    reads = [bytes([good[0] ^ 0xFF]) + good[1:], good]
    got = crctable.with_table(manifest, lambda: reads.pop(0), 3, "here")
    assert not got.modified and not reads  # read twice, the second time right
    assert got.arrays["a"].committed_crc32c == good[: len(got.arrays["a"].committed_crc32c)]
    bad = bytes([good[0] ^ 0xFF]) + good[1:]
    stored = crctable.with_table(manifest, lambda: bad, 3, "here")  # the same bytes twice: what is stored
    assert set(stored.modified) == {"a"}
    meta = manifest.arrays["b"]
    assert meta.crc_segment is not None
    offset, nbytes, _ = meta.crc_segment
    assert crctable.read_segment(storage, meta) == good[offset : offset + nbytes]


def test_reading_a_chunk_before_its_checksums_is_an_error_not_an_unchecked_read(ckpt: Path) -> None:
    from zarrckpt.engine.reader import Request, read_regions
    from zarrckpt.errors import ZarrckptError
    from zarrckpt.format.layout import Box

    manifest = Manifest.loads((ckpt / "zarr.json").read_bytes(), "here")  # (no table attached)
    meta = manifest.arrays["b"]
    with pytest.raises(ZarrckptError, match="were not read before its chunks"):
        read_regions(Storage(str(ckpt)), [Request(meta, Box((0,), (48,)), torch.empty(48).numpy())])


def test_lazy_reads_on_s3_open_one_get_first_slice_one_round_trip_later_one_get(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog
) -> None:
    url, opts = s3_url
    zarrckpt.save(_state(), url, storage_options=opts, chunk_bytes=1024)
    s3_requests.clear()
    ckpt = zarrckpt.open(url, storage_options=opts)
    assert [r.path.rsplit("/", 1)[-1] for r in s3_requests.requests()] == ["zarr.json"]  # open: the manifest only
    s3_requests.clear()
    assert torch.equal(ckpt["a"][10:12], _state()["a"][10:12])
    first = s3_requests.requests()
    at = _record_remote(ckpt)["a"]
    table = [r for r in first if r.path.endswith(integrity.TABLE)]
    assert len(first) == 2 and len(table) == 1  # the data and the array's segment, side by side
    assert table[0].range == f"bytes={at['offset']}-{at['offset'] + at['bytes'] - 1}"
    s3_requests.clear()
    view = ckpt["a"]
    assert torch.equal(view[40:41], _state()["a"][40:41])
    assert len(s3_requests.requests()) == 1  # its segment is cached: the data only


def _record_remote(ckpt: zarrckpt.Checkpoint) -> dict[str, Any]:
    return {
        m.key: {"offset": m.crc_segment[0], "bytes": m.crc_segment[1]}
        for m in ckpt.manifest.arrays.values()
        if m.crc_segment
    }


def test_a_tensors_first_read_sends_its_segment_and_data_together(s3_server: str) -> None:
    """Behind a proxy that holds every request 0.3 s (a far server), the segment's GET and the data
    GET are in flight together: each arrives before the other is answered (one round trip, not two)."""
    from zarrckpt.testing import unique_url
    from zarrckpt.testing.proxy import FaultProxy
    from zarrckpt.testing.s3 import s3_storage_options

    proxy = FaultProxy(s3_server)
    try:
        url, opts = unique_url("s3"), s3_storage_options(proxy.endpoint)
        zarrckpt.save(_state(), url, storage_options=opts, chunk_bytes=1024)
        ckpt = zarrckpt.open(url, storage_options=opts)
        proxy.delay, proxy.timeline = 0.3, []
        assert torch.equal(ckpt["a"][10:12], _state()["a"][10:12])
        gets = [
            (path.rsplit("/", 1)[-1].split("?")[0], arrived, answered) for _, path, arrived, answered in proxy.timeline
        ]
        assert sorted(name for name, _, _ in gets) == sorted([integrity.TABLE, "c.0.0"]), gets  # (the shard a/c.0.0)
        assert max(arrived for _, arrived, _ in gets) < min(answered for _, _, answered in gets), gets
    finally:
        proxy.close()


def test_format_md_example_record_is_the_record_of_its_state(tmp_path: Path) -> None:
    """docs/FORMAT.md §6's ``integrity`` example and its worked ``meta_crc32c`` inputs are what a save of
    the state it names writes: a reader implementing the record can check its digests against them."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md").read_text()
    state = {
        "model": {"embed": {"weight": torch.arange(512 * 64, dtype=torch.float32).reshape(512, 64)}},
        "optim": {"loss_scale": torch.tensor(100.0)},
    }
    zarrckpt.save(state, str(tmp_path / "ck"), chunk_bytes=8192)
    record = _record(tmp_path / "ck")["integrity"]
    weight, scale = record["arrays"]["model/embed/weight"], record["arrays"]["optim/loss_scale"]
    example = text.split('"integrity": {"table"', 1)[1].split('"attributes_crc32c"', 1)[0]
    numbers = [int(n) for n in re.findall(r'"(?:crc32c|meta_crc32c)": (\d+)', example)]
    assert numbers == [record["table"]["crc32c"], weight["meta_crc32c"], weight["chunk_table"]["crc32c"]]
    worked = {
        '["model.embed.weight",[512,64],"float32",[512,64],[32,64],"main_weight","tensor","","."]': weight,
        '["optim.loss_scale",[],"float32",[],[],"other","tensor","","0000c842","."]': scale,
    }
    for digest_input, entry in worked.items():
        assert f"`{digest_input}`" in text, f"FORMAT.md no longer shows {digest_input}"
        assert crc32c.crc32c(digest_input.encode()) == entry["meta_crc32c"]
        assert str(entry["meta_crc32c"]) in text
