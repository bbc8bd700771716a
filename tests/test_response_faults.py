"""Answers damaged on their way back: a real HTTP proxy (zarrckpt.testing.proxy) in front of a real
S3 server (moto; Ceph RGW where installed) flips one byte of chosen responses, as a flaky network,
NIC or middlebox would, which no status code says.

A read whose bytes fail their check (a chunk's or a shard index's crc32c, a manifest that is no
text, no JSON or fails its attributes_crc32c, a listing that does not parse) is read again before
anything is reported, so an intact checkpoint reads right through a few such answers (load,
open + index, verify); the same bytes twice are what is stored, and a really corrupted object
fails as before, after one read more.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt.errors import CorruptChunkError, InvalidCheckpointError
from zarrckpt.lifecycle import read_head
from zarrckpt.storage.store import Storage
from zarrckpt.testing import rgw, s3_storage_options, unique_url
from zarrckpt.testing.proxy import FaultProxy

ROWS, COLS = 512, 1024  # 8 inner chunks of [64, 1024] (256 KiB) in one 2 MiB shard
HEAD = 16 * 8 + 4
CHUNK = 64 * COLS * 4 + 4
VALUES = {"trainer": {"step": 1000, "tokens": 123_456_789}, "config": {"name": "tiny", "lr": 3e-4}}


def _state() -> dict[str, Any]:
    return {"w": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS), **VALUES}


def _target() -> dict[str, Any]:
    return {"w": torch.zeros(ROWS, COLS), "trainer": {"step": 0, "tokens": 0}, "config": {"name": "", "lr": 0.0}}


@pytest.fixture(params=["obstore", "s3fs"])
def client(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("ZARRCKPT_S3_CLIENT", request.param)
    return str(request.param)


def _saved(options: dict[str, Any]) -> str:
    url = unique_url("s3")
    zarrckpt.save(_state(), url, storage_options=options, chunk_bytes=64 * COLS * 4)
    return url


@pytest.fixture
def moto(s3_server: str) -> Iterator[tuple[str, FaultProxy, dict[str, Any]]]:
    """A checkpoint saved on moto, and a proxy in front of moto (options to reach it through the proxy)."""
    url = _saved(s3_storage_options(s3_server))
    proxy = FaultProxy(s3_server)
    yield url, proxy, s3_storage_options(proxy.endpoint)
    proxy.close()


def _gets(path_end: str) -> Callable[[str, str, int, bytes], bool]:
    """A ``response_flip_if``: object reads (GET, 200/206, a body) of paths ending so."""
    return lambda method, path, status, body: (
        method == "GET" and status in (200, 206) and path.split("?")[0].endswith(path_end)
    )


def _reads_right_through_damage(url: str, proxy: FaultProxy, opts: dict[str, Any]) -> None:
    """Open, index, load and verify an intact checkpoint while answers of each kind arrive damaged."""
    full = _state()["w"]
    proxy.response_flip_if = _gets("/zarr.json")  # the manifest (open reads it first)
    proxy.response_flips = 1
    ckpt = zarrckpt.open(url, storage_options=opts)
    assert ckpt.metadata == VALUES and proxy.response_flips == 0
    assert ckpt.stats()["retries"] >= 1
    proxy.response_flip_if = _gets("/w/c.0.0")  # the shard: a run of whole chunks, without the index
    proxy.response_flips = 2
    assert torch.equal(ckpt["w"][64:320], full[64:320]) and proxy.response_flips == 0
    proxy.response_flip_if = _gets("")  # every object read of a load: the manifest, the shard
    for _ in range(3):
        proxy.response_flips = 1
        target = _target()
        zarrckpt.load(target, url, storage_options=opts)
        assert torch.equal(target["w"], full) and target["trainer"] == VALUES["trainer"]
        assert proxy.response_flips == 0
    proxy.response_flip_if = _gets("/w/c.0.0")  # verify reads the shard whole (index and chunks)
    for _ in range(3):
        proxy.response_flips = 1
        summary = ckpt.verify()
        assert summary["problems"] == [] and proxy.response_flips == 0
    assert len(proxy.response_flipped) == 1 + 2 + 3 + 3


def test_damaged_answers_are_read_again(client: str, moto: tuple[str, FaultProxy, dict[str, Any]]) -> None:
    _reads_right_through_damage(*moto)


def test_damaged_answers_are_read_again_on_rgw(client: str, rgw_server: str) -> None:
    options = rgw.rgw_storage_options(rgw_server)
    url = _saved(options)
    proxy = FaultProxy(rgw_server)
    try:
        _reads_right_through_damage(url, proxy, {**options, "endpoint_url": proxy.endpoint})
    finally:
        proxy.close()


@pytest.mark.parametrize(
    ("server", "name"),
    # (s3fs on moto is left out: botocore checks whole-object answers against the CRC moto stored
    # from the upload, and asks again itself; RGW 16.2 stores none)
    [("moto", "obstore"), ("rgw", "obstore"), ("rgw", "s3fs")],
)
def test_a_manifest_with_one_bit_flipped_is_read_again(
    server: str, name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One bit, anywhere in the manifest's answer: mostly still text, often still JSON; its checks
    (JSON, the group, the attributes_crc32c, each array's commit record) fail, and it is read again."""
    monkeypatch.setenv("ZARRCKPT_S3_CLIENT", name)
    endpoint = request.getfixturevalue("s3_server" if server == "moto" else "rgw_server")
    options = s3_storage_options(endpoint) if server == "moto" else rgw.rgw_storage_options(endpoint)
    url = _saved(options)
    proxy = FaultProxy(endpoint)
    request.addfinalizer(proxy.close)
    opts = {**options, "endpoint_url": proxy.endpoint}
    proxy.response_flip_if = _gets("/zarr.json")
    proxy.response_mask = 0x01
    for _ in range(24):
        proxy.response_flips = 1
        ckpt = zarrckpt.open(url, storage_options=opts)
        assert proxy.response_flips == 0
        assert ckpt.metadata == VALUES and ckpt.keys() == ["w"] and not ckpt.manifest.modified
        assert torch.equal(ckpt["w"][3], _state()["w"][3])
    for _ in range(12):  # the load path: rank 0 reads the manifest, every rank parses and checks it
        proxy.response_flips = 1
        target = _target()
        zarrckpt.load(target, url, storage_options=opts)
        assert proxy.response_flips == 0
        assert torch.equal(target["w"], _state()["w"]) and target["trainer"] == VALUES["trainer"]


def test_the_head_ls_reads_is_read_again_when_damaged(
    moto: tuple[str, FaultProxy, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`zarrckpt ls` reads each manifest's head (one ranged GET; the whole of a small manifest): a
    byte that is no text there is read again, not reported as a manifest that is no JSON. (obstore:
    under s3fs, botocore checks a whole-object answer against the CRC moto stored, and asks again.)"""
    monkeypatch.setenv("ZARRCKPT_S3_CLIENT", "obstore")
    url, proxy, opts = moto
    proxy.response_flip_if = _gets("/zarr.json")
    for _ in range(4):
        proxy.response_flips = 1
        head = read_head(url, storage_options=opts)
        assert proxy.response_flips == 0 and head.values["trainer.step"] == 1000 and head.tensors == 1


def _in_listing(text: bytes, offset: int) -> Callable[[bytes], int]:
    """A ``response_flip_at``: byte ``offset`` of the first ``text`` in a listing."""
    return lambda body: body.index(text) + offset


@pytest.mark.parametrize("damage", ["a key's name", "a time stamp"])
def test_a_damaged_listing_makes_verify_report_nothing_amiss(
    client: str, moto: tuple[str, FaultProxy, dict[str, Any]], damage: str
) -> None:
    """verify goes by a listing of what is stored. A bit flipped in a key (w/c.0.0 -> w/c.0.1) still
    parses: verify lists the array again before it believes a shard missing and a stray there. A
    time stamp that is none fails the listing's parse (obstore's, botocore's): it is asked again,
    not reported as a listing that failed."""
    url, proxy, opts = moto
    ckpt = zarrckpt.open(url, storage_options=opts)

    def listing(method: str, path: str, status: int, body: bytes) -> bool:
        return method == "GET" and status == 200 and "list-type=2" in path and b"w/c.0.0</Key>" in body

    proxy.response_flip_if = listing
    if damage == "a key's name":
        proxy.response_mask, proxy.response_flip_at = 0x01, _in_listing(b"w/c.0.0</Key>", 6)
    else:
        proxy.response_mask, proxy.response_flip_at = 0x01, _in_listing(b"Z</LastModified>", 0)  # Z -> [
    proxy.response_flips = 1
    summary = ckpt.verify()
    assert proxy.response_flips == 0, "the proxy damaged a listing"
    assert summary["problems"] == [], summary


def test_really_corrupted_objects_fail_as_before_after_one_read_more(
    client: str, moto: tuple[str, FaultProxy, dict[str, Any]], s3_server: str
) -> None:
    """A chunk whose stored bytes fail their crc32c: the read, the same bytes again, the index (to tell
    another writer's layout from damage): then CorruptChunkError as before. A manifest stored as no
    JSON: read twice, then InvalidCheckpointError as before."""
    url, proxy, opts = moto
    direct = Storage(url, s3_storage_options(s3_server))
    raw = bytearray(direct.read("w/c.0.0"))
    raw[HEAD + 2 * CHUNK + 100] ^= 0x10  # inner chunk 2
    direct.write("w/c.0.0", [bytes(raw)])
    ckpt = zarrckpt.open(url, storage_options=opts)
    proxy.answered.clear()
    with pytest.raises(CorruptChunkError, match=r"inner chunk \[2, 0\]\) of 'w' fails its crc32c checksum"):
        ckpt["w"][128:192]
    shard = [(m, p) for m, p, _ in proxy.answered if p.split("?")[0].endswith("/w/c.0.0")]
    assert len(shard) == 3, proxy.answered  # the chunk, the chunk again (the same bytes), the index
    with pytest.raises(CorruptChunkError, match="fails its crc32c checksum"):
        zarrckpt.load(_target(), url, storage_options=opts)
    summary = ckpt.verify()
    assert len(summary["problems"]) == 1 and "fails its crc32c checksum" in summary["problems"][0]

    manifest = direct.read("zarr.json")
    direct.write("zarr.json", [manifest[:100] + b"\xff" + manifest[101:]])
    proxy.answered.clear()
    with pytest.raises(InvalidCheckpointError, match="is invalid: not JSON"):
        zarrckpt.open(url, storage_options=opts)
    assert [m for m, p, _ in proxy.answered if p.split("?")[0].endswith("/zarr.json")] == ["GET", "GET"]
    doc = json.loads(manifest)
    doc["attributes"]["zarrckpt"]["values"]["trainer.step"] = 999  # an edit: attributes_crc32c fails, stored
    direct.write("zarr.json", [json.dumps(doc).encode()])
    proxy.answered.clear()
    with pytest.raises(zarrckpt.ModifiedCheckpointError, match="modified after commit"):
        _ = zarrckpt.open(url, storage_options=opts).metadata
    assert [m for m, p, _ in proxy.answered if p.split("?")[0].endswith("/zarr.json")] == ["GET", "GET"]
