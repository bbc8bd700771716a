"""Request budget against a real moto S3 server: requests and bytes counted by the server itself.

Opening a checkpoint is one open-range GET of the manifest (no HEAD first), however many tensors
it holds. A lazy view fetches the shard index and the bytes it
needs, not whole inner chunks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
import torch

import zarrckpt
from zarrckpt.testing import RequestLog, S3Request, s3_storage_options, spawn, under, unique_url

EXPERTS, ROWS, COLS = 64, 256, 256
WORLD = 8
PER_RANK = EXPERTS // WORLD
INDEX_BYTES = 16 * 1 + 4  # one inner chunk per shard: one index entry + the index crc32c


def _expert_block(lo: int, hi: int) -> torch.Tensor:
    """Experts ``lo:hi`` of the global tensor whose element i is float(i) (exact in float32)."""
    return torch.arange(lo * ROWS * COLS, hi * ROWS * COLS, dtype=torch.float32).reshape(hi - lo, ROWS, COLS)


def _save_experts(rank: int, world: int, url: str, opts: dict[str, Any]) -> None:
    lo = rank * PER_RANK
    block = zarrckpt.LocalShard(_expert_block(lo, lo + PER_RANK), (EXPERTS, ROWS, COLS), (lo, 0, 0))
    zarrckpt.save({"model": {"experts": {"w1": block}}}, url, storage_options=opts)


@pytest.fixture(scope="module")
def experts_url(s3_server: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """A [64, 256, 256] float32 tensor saved by 8 gloo ranks, 8 experts each (saved once per module)."""
    url, opts = unique_url("s3"), s3_storage_options(s3_server)
    spawn(WORLD, _save_experts, url, opts)
    yield url, opts
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.rm(root, recursive=True)


def _kinds(requests: list[S3Request]) -> Counter[str]:
    return Counter(r.kind for r in requests)


def test_open_1000_tensors_is_one_get(s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog) -> None:
    url, opts = s3_url
    zarrckpt.save({"model": {f"t{i}": torch.full((3,), float(i)) for i in range(1000)}}, url, storage_options=opts)
    s3_requests.clear()
    ckpt = zarrckpt.open(url, storage_options=opts)
    assert len(ckpt) == 1000
    got = s3_requests.requests()
    # the manifest is read with an open range (bytes=0-), so s3fs sends no HEAD for its size
    assert [(r.kind, r.path, r.status) for r in got] == [("GET", f"/{url[5:]}/zarr.json", 206)]


@pytest.mark.parametrize(
    ("index", "start"),
    [
        ((5,), 5 * ROWS * COLS),  # one whole expert: 256 KiB
        ((5, 17), (5 * ROWS + 17) * COLS),  # one row of it: 1 KiB
    ],
    ids=["expert", "row"],
)
def test_lazy_view_reads_only_what_it_needs(
    experts_url: tuple[str, dict[str, Any]], s3_requests: RequestLog, index: tuple[int, ...], start: int
) -> None:
    url, opts = experts_url
    ckpt = zarrckpt.open(url, storage_options=opts)
    meta = ckpt["model.experts.w1"].meta
    assert (meta.shard_shape, meta.chunk_shape) == ((PER_RANK, ROWS, COLS),) * 2  # one 2 MiB chunk per rank
    s3_requests.clear()
    got = ckpt["model.experts.w1"][index]
    want = _expert_block(5, 6)[0][index[1:]]
    assert torch.equal(got, want)
    requested = got.numel() * 4
    log = s3_requests.requests()
    shard = f"/{url[5:]}/model/experts/w1/c/0/0/0"
    first = INDEX_BYTES + start * 4  # the data follows the index
    assert [(r.kind, r.path, r.range, r.status) for r in log] == [
        ("GET", shard, f"bytes=0-{INDEX_BYTES - 1}", 206),
        ("GET", shard, f"bytes={first}-{first + requested - 1}", 206),
    ]
    transferred = sum(r.bytes_sent for r in log)
    assert transferred == requested + INDEX_BYTES <= 1.25 * requested + INDEX_BYTES
    assert len(log) <= 4


def test_verified_reads_fetch_whole_chunks(experts_url: tuple[str, dict[str, Any]], s3_requests: RequestLog) -> None:
    """partial_reads=False: whole inner chunks, each checked against its crc32c (one GET per shard here)."""
    url, opts = experts_url
    ckpt = zarrckpt.open(url, storage_options=opts, partial_reads=False)
    s3_requests.clear()
    assert torch.equal(ckpt["model.experts.w1"][5, 17], _expert_block(5, 6)[0, 17])
    log = s3_requests.requests()
    whole = INDEX_BYTES + PER_RANK * ROWS * COLS * 4 + 4
    assert [(r.kind, r.range, r.bytes_sent) for r in log] == [("GET", "bytes=0-", whole)]


def test_verify_reads_each_shard_once(experts_url: tuple[str, dict[str, Any]], s3_requests: RequestLog) -> None:
    """verify(): one GET per shard object, all of it (no HEAD first), every chunk checked; and one
    GET of the array's own zarr.json (compared with the manifest)."""
    url, opts = experts_url
    ckpt = zarrckpt.open(url, storage_options=opts)
    s3_requests.clear()
    summary = ckpt.verify()
    whole = INDEX_BYTES + PER_RANK * ROWS * COLS * 4 + 4
    requests = s3_requests.requests()
    docs = [r for r in requests if r.path.endswith("/zarr.json")]
    assert [(r.kind, r.path, r.range) for r in docs] == [("GET", f"/{url[5:]}/model/experts/w1/zarr.json", "bytes=0-")]
    assert summary["problems"] == [] and summary["bytes_read"] == WORLD * whole + docs[0].bytes_sent
    got = sorted((r.kind, r.path.rsplit("/", 3)[-3], r.range, r.bytes_sent) for r in requests if r not in docs)
    assert got == [("GET", str(rank), "bytes=0-", whole) for rank in range(WORLD)]


def test_strided_views(experts_url: tuple[str, dict[str, Any]], s3_requests: RequestLog) -> None:
    """Rows 1 KiB long, 256 KiB apart: coalesced into one range, with the index when it is close,
    else with the chunk's stored crc32c (checked against the commit record) when that is close;
    a view needing most of a chunk reads it whole and verifies it."""
    url, opts = experts_url
    view = zarrckpt.open(url, storage_options=opts)["model.experts.w1"]
    row = COLS * 4
    s3_requests.clear()
    assert torch.equal(view[6:8, 17], _expert_block(6, 8)[:, 17])  # experts 6 and 7 of shard 0
    # 238 KiB from the last row to the chunk's crc32c: read through, no index GET
    lo, hi = INDEX_BYTES + (6 * ROWS + 17) * row, INDEX_BYTES + PER_RANK * ROWS * row + 4
    assert [(r.range, r.bytes_sent) for r in s3_requests.requests()] == [
        (f"bytes={lo}-{hi - 1}", hi - lo),  # 495 KiB for 2 KiB: fewer requests beat fewer bytes here
    ]
    s3_requests.clear()
    assert torch.equal(view[:2, 17], _expert_block(0, 2)[:, 17])  # experts 0 and 1: 255 KiB apart, one GET
    end = INDEX_BYTES + (ROWS + 18) * row
    assert [(r.range, r.bytes_sent) for r in s3_requests.requests()] == [(f"bytes=0-{end - 1}", end)]
    s3_requests.clear()
    assert torch.equal(view[:, 17], _expert_block(0, EXPERTS)[:, 17])  # ranges would span 7/8 of each chunk
    whole = INDEX_BYTES + PER_RANK * ROWS * row + 4
    got = sorted((r.path.rsplit("/", 3)[-3], r.range, r.bytes_sent) for r in s3_requests.requests())
    assert got == [(str(rank), "bytes=0-", whole) for rank in range(WORLD)]


def test_request_log_counts_requests_and_bytes(s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog) -> None:
    """The counter itself: a PUT, a ranged GET and a listing, as the server saw them."""
    url, opts = s3_url
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.pipe_file(f"{root}/a", b"0123456789" * 100)
    assert fs.cat_file(f"{root}/a", start=10, end=110) == b"0123456789" * 10
    assert fs.ls(root, detail=False, refresh=True) == [f"{root}/a"]
    log = s3_requests.requests(url)
    assert [(r.kind, r.range, r.bytes_received) for r in log] == [
        ("PUT", None, 1000),
        ("GET", "bytes=10-109", 0),
        ("LIST", None, 0),
    ]
    assert [r.bytes_sent for r in log[:2]] == [0, 100] and log[2].bytes_sent > 0
    assert log[2].query["prefix"] == [url.split("/", 3)[-1] + "/"]
    assert s3_requests.requests(url + "-other") == [] and len(s3_requests.requests()) == 3
    # a sibling whose name starts with the prefix's is not under it
    assert s3_requests.requests(url[:-1]) == []


def test_prefix_rule() -> None:
    """A key is under prefix P iff it is P or starts with P + "/" (the one rule of zarrckpt.testing)."""
    assert under("b/run", "b/run") and under("b/run/x", "b/run") and under("b/run/x", "b/run/")
    assert not under("b/run-1", "b/run") and not under("b/ru", "b/run") and not under("c/run", "b/run")
    assert under("b/anything", "b") and under("b/x", "")
    listing = S3Request("GET", "/b", {"prefix": ["run/"]}, None, 200, 10, 0)
    assert listing.kind == "LIST" and listing.touches("b/run") and not listing.touches("b/ru")
    assert not S3Request("GET", "/b", {"prefix": ["run-1/"]}, None, 200, 10, 0).touches("b/run")
    delete = S3Request("POST", "/b", {"delete": [""]}, None, 200, 10, 99)
    assert not delete.touches("b/run") and delete.touches("b")


def _load_experts(rank: int, world: int, url: str, opts: dict[str, Any]) -> None:
    per = EXPERTS // world
    lo = rank * per
    target = zarrckpt.LocalShard(torch.zeros(per, ROWS, COLS), (EXPERTS, ROWS, COLS), (lo, 0, 0))
    zarrckpt.load({"model": {"experts": {"w1": target}}}, url, storage_options=opts)
    assert torch.equal(target.data, _expert_block(lo, lo + per))


def test_a_load_reads_the_manifest_once_per_job(
    experts_url: tuple[str, dict[str, Any]], s3_requests: RequestLog
) -> None:
    """4 ranks load: rank 0 reads the manifest and hands its bytes to the others (one GET, not 4),
    and makes the end-of-load check (one more), whatever the world size."""
    url, opts = experts_url
    s3_requests.clear()
    spawn(4, _load_experts, url, opts)
    manifest = [r for r in s3_requests.requests() if r.path == f"/{url[5:]}/zarr.json"]
    assert [(r.kind, r.range) for r in manifest] == [("GET", "bytes=0-"), ("GET", "bytes=0-")]


def _rows_target(lo: int, hi: int) -> dict[str, Any]:
    return {"w": zarrckpt.LocalShard(torch.zeros(hi - lo, 1024), (512, 1024), (lo, 0))}


def test_chunks_are_read_without_the_shard_index(s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog) -> None:
    """A 2 MiB shard of 8 inner chunks (64 rows each); rows 100:300 need chunks 1-4: one ranged GET,
    no index GET (each chunk is checked against the crc32c the commit recorded for it)."""
    url, opts = s3_url
    full = torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)
    zarrckpt.save({"w": full}, url, storage_options=opts, chunk_bytes=256 * 1024)
    s3_requests.clear()
    target = _rows_target(100, 300)
    zarrckpt.load(target, url, storage_options=opts)
    assert torch.equal(target["w"].data, full[100:300])
    chunk = 64 * 1024 * 4 + 4
    start = 16 * 8 + 4 + chunk  # chunk 1, right after the index and chunk 0
    shard = [(r.kind, r.range) for r in s3_requests.requests() if r.path.endswith("/w/c/0/0")]
    assert shard == [("GET", f"bytes={start}-{start + 4 * chunk - 1}")]


def test_a_rewritten_layout_is_explained_by_the_index(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog
) -> None:
    """Another writer put the same chunks in reverse order: the index-less read fails its checksum,
    the reader then fetches the index and reports the rewrite (not "corrupted")."""
    import struct

    import crc32c

    url, opts = s3_url
    full = torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)
    zarrckpt.save({"w": full}, url, storage_options=opts, chunk_bytes=256 * 1024)
    rows = [full[64 * k : 64 * (k + 1)].numpy().tobytes() for k in range(8)]
    head = 16 * 8 + 4
    entries, body = [], b""
    for k in reversed(range(8)):
        entries.append((k, head + len(body), len(rows[k]) + 4))
        body += rows[k] + struct.pack("<I", crc32c.crc32c(rows[k]))
    index = b"".join(struct.pack("<QQ", o, n) for _, o, n in sorted(entries))
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.pipe_file(f"{root}/w/c/0/0", index + struct.pack("<I", crc32c.crc32c(index)) + body)
    with pytest.raises(zarrckpt.ModifiedCheckpointError, match="not laid out as zarrckpt wrote it"):
        zarrckpt.load(_rows_target(100, 300), url, storage_options=opts)
    target = _rows_target(100, 300)
    zarrckpt.load(target, url, storage_options=opts, allow_modified=True)
    assert torch.equal(target["w"].data, full[100:300])


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_is_empty_is_one_listing_however_many_objects(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog, monkeypatch: pytest.MonkeyPatch, client: str
) -> None:
    """Is anything stored under a prefix (a failed open tells "nothing there" from "never committed";
    verify checks a constant array has no chunks): one LIST, not a listing of every object."""
    from zarrckpt.storage import Storage

    monkeypatch.setenv("ZARRCKPT_S3_CLIENT", client)
    url, opts = s3_url
    store = Storage(url, opts)
    store.run_all(lambda i: store.write(f"a/c/{i}", [b"x"]), range(1001), writing=True)  # > 1 page of 1,000
    s3_requests.clear()
    assert not store.is_empty()
    assert [r.kind for r in s3_requests.requests()] == ["LIST"]
    s3_requests.clear()
    assert store.child("a").child("nothing").is_empty()
    # s3fs lists the parent too, to tell an empty directory from a missing one; obstore asks whether
    # the path is itself an object (a 0-d array's chunk "c")
    assert [r.kind for r in s3_requests.requests()] == (["LIST", "LIST"] if client == "s3fs" else ["LIST", "HEAD"])
    with pytest.raises(zarrckpt.errors.IncompleteCheckpointError, match="never committed"):
        zarrckpt.open(url, storage_options=opts)
