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
from zarrckpt.format import integrity
from zarrckpt.plan import targets
from zarrckpt.testing import RequestLog, S3Request, s3_storage_options, spawn, under, unique_url

EXPERTS, ROWS, COLS = 64, 256, 256
WORLD = 8
PER_RANK = EXPERTS // WORLD
INDEX_BYTES = 16 * PER_RANK + 4  # one inner chunk per expert (256 KiB): 8 index entries + the index crc32c
CHUNK_BYTES = ROWS * COLS * 4 + 4  # one stored inner chunk: an expert's elements and their crc32c


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


def _segment_get(log: list[Any], meta: Any) -> list[Any]:
    """``log`` less the one GET of ``meta``'s segment of the chunk checksum table, which a tensor's
    first read sends beside its data GET (checked here: exactly that range, once)."""
    offset, nbytes, _ = meta.crc_segment
    table = [r for r in log if r.path.endswith("/" + integrity.TABLE)]
    assert [(r.kind, r.range, r.bytes_sent) for r in table] == [
        ("GET", f"bytes={offset}-{offset + nbytes - 1}", nbytes)
    ]
    return [r for r in log if r not in table]


def test_a_lazy_expert_is_one_get_of_its_own_chunk(
    experts_url: tuple[str, dict[str, Any]], s3_requests: RequestLog
) -> None:
    """Each expert of the [8, 256, 256] shards is an inner chunk of its own (a stack's slices of at
    least 64 KiB are): reading one after open is one ranged GET of that chunk, checked whole by its
    crc32c against the commit record; no index GET."""
    url, opts = experts_url
    ckpt = zarrckpt.open(url, storage_options=opts)
    meta = ckpt["model.experts.w1"].meta
    assert (meta.shard_shape, meta.chunk_shape) == ((PER_RANK, ROWS, COLS), (1, ROWS, COLS))
    s3_requests.clear()
    got = ckpt["model.experts.w1"][5]
    assert torch.equal(got, _expert_block(5, 6)[0])
    first = INDEX_BYTES + 5 * CHUNK_BYTES  # expert 5 is chunk 5 of shard 0
    shard = f"/{url[5:]}/model/experts/w1/c.0.0.0"
    log = _segment_get(s3_requests.requests(), meta)
    assert [(r.kind, r.path, r.range, r.status) for r in log] == [
        ("GET", shard, f"bytes={first}-{first + CHUNK_BYTES - 1}", 206)
    ]
    assert sum(r.bytes_sent for r in log) == got.numel() * 4 + 4 <= 1.25 * got.numel() * 4


def test_a_lazy_row_is_one_get_with_its_chunks_crc32c(
    experts_url: tuple[str, dict[str, Any]], s3_requests: RequestLog
) -> None:
    """One 1 KiB row of expert 5 near its chunk's start (row 17 of 256): reading from it through the
    chunk's stored crc32c (to prove it is the committed chunk) would move more than half the chunk,
    so the chunk is read whole and checked by its crc32c: one GET, no index GET. A row in the
    second half is read from the row through the stored crc32c, compared with the commit record."""
    url, opts = experts_url
    view = zarrckpt.open(url, storage_options=opts)["model.experts.w1"]
    s3_requests.clear()
    assert torch.equal(view[5, 17], _expert_block(5, 6)[0, 17])
    first = INDEX_BYTES + 5 * CHUNK_BYTES
    end = INDEX_BYTES + 6 * CHUNK_BYTES
    assert [(r.kind, r.range, r.bytes_sent) for r in _segment_get(s3_requests.requests(), view.meta)] == [
        ("GET", f"bytes={first}-{end - 1}", end - first)
    ]
    s3_requests.clear()
    assert torch.equal(view[5, 200], _expert_block(5, 6)[0, 200])
    first = INDEX_BYTES + 5 * CHUNK_BYTES + 200 * COLS * 4
    assert [(r.kind, r.range, r.bytes_sent) for r in s3_requests.requests()] == [
        ("GET", f"bytes={first}-{end - 1}", end - first)
    ]


def test_verified_reads_fetch_whole_chunks(experts_url: tuple[str, dict[str, Any]], s3_requests: RequestLog) -> None:
    """partial_reads=False: whole inner chunks, each checked against its crc32c: the row's chunk
    (expert 5), one ranged GET, no index GET (the commit record gives the offsets)."""
    url, opts = experts_url
    ckpt = zarrckpt.open(url, storage_options=opts, partial_reads=False)
    s3_requests.clear()
    assert torch.equal(ckpt["model.experts.w1"][5, 17], _expert_block(5, 6)[0, 17])
    log = _segment_get(s3_requests.requests(), ckpt["model.experts.w1"].meta)
    first = INDEX_BYTES + 5 * CHUNK_BYTES
    assert [(r.kind, r.range, r.bytes_sent) for r in log] == [
        ("GET", f"bytes={first}-{first + CHUNK_BYTES - 1}", CHUNK_BYTES)
    ]


def test_verify_reads_each_shard_once(experts_url: tuple[str, dict[str, Any]], s3_requests: RequestLog) -> None:
    """verify(): one GET of the chunk checksum table, one listing of the checkpoint (what is there,
    with sizes), then one GET per shard object, all of it (no HEAD first), every chunk checked; and
    one GET of the array's own zarr.json (compared with the manifest)."""
    url, opts = experts_url
    ckpt = zarrckpt.open(url, storage_options=opts)
    s3_requests.clear()
    summary = ckpt.verify()
    whole = INDEX_BYTES + PER_RANK * CHUNK_BYTES
    requests = s3_requests.requests()
    table = [r for r in requests if r.path.endswith("/" + integrity.TABLE)]
    assert [(r.kind, r.range) for r in table] == [("GET", "bytes=0-")]
    requests = [r for r in requests if r not in table]
    docs = [r for r in requests if r.path.endswith("/zarr.json")]
    assert [(r.kind, r.path, r.range) for r in docs] == [("GET", f"/{url[5:]}/model/experts/w1/zarr.json", "bytes=0-")]
    assert summary["problems"] == [] and summary["bytes_read"] == WORLD * whole + docs[0].bytes_sent
    listings = [r for r in requests if r.kind == "LIST"]
    assert len(listings) == 1 and listings[0].query["prefix"] == [url.split("/", 3)[-1] + "/"]
    got = sorted(
        (r.kind, r.path.rsplit("/", 1)[-1].split(".")[1], r.range, r.bytes_sent)  # .../w1/c.R.0.0: rank R's
        for r in requests
        if r not in docs + listings
    )
    assert got == [("GET", str(rank), "bytes=0-", whole) for rank in range(WORLD)]


def test_strided_views(experts_url: tuple[str, dict[str, Any]], s3_requests: RequestLog) -> None:
    """Rows 1 KiB long, 256 KiB apart (one per expert, each expert its own chunk): coalesced into one
    range, each chunk's piece with its stored crc32c (checked against the commit record), or the
    chunk whole when the piece lies in its first half; never the index."""
    url, opts = experts_url
    view = zarrckpt.open(url, storage_options=opts)["model.experts.w1"]
    row = COLS * 4
    s3_requests.clear()
    assert torch.equal(view[6:8, 17], _expert_block(6, 8)[:, 17])  # experts 6 and 7 of shard 0
    # row 17 of 256: both chunks read whole (and verified), in one GET (beside the tensor's checksums)
    lo, hi = INDEX_BYTES + 6 * CHUNK_BYTES, INDEX_BYTES + PER_RANK * CHUNK_BYTES
    log = _segment_get(s3_requests.requests(), view.meta)
    assert [(r.range, r.bytes_sent) for r in log] == [(f"bytes={lo}-{hi - 1}", hi - lo)]
    s3_requests.clear()
    assert torch.equal(view[:2, 200], _expert_block(0, 2)[:, 200])  # experts 0 and 1, past their chunks' middle
    lo, hi = INDEX_BYTES + 200 * row, INDEX_BYTES + 2 * CHUNK_BYTES  # from row 200 of chunk 0 through chunk 1's crc
    assert [(r.range, r.bytes_sent) for r in s3_requests.requests()] == [(f"bytes={lo}-{hi - 1}", hi - lo)]


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
    """4 ranks load: rank 0 reads the manifest and hands its bytes to the others: one GET, not 4,
    whatever the world size. No end-of-load re-read: every chunk used was compared with the commit
    record, so no save replacing the checkpoint meanwhile can have mixed into what was loaded."""
    url, opts = experts_url
    s3_requests.clear()
    spawn(4, _load_experts, url, opts)
    manifest = [r for r in s3_requests.requests() if r.path == f"/{url[5:]}/zarr.json"]
    assert [(r.kind, r.range) for r in manifest] == [("GET", "bytes=0-")]


def test_allow_modified_rereads_the_manifest_at_the_end(
    experts_url: tuple[str, dict[str, Any]], s3_requests: RequestLog
) -> None:
    """Reading shards as they are now (no comparison with the commit record), the load checks at the
    end that the manifest is still the one it began with: a second GET, of its head only (the save
    id comes before the large fields)."""
    url, opts = experts_url
    target = {"model": {"experts": {"w1": torch.zeros(EXPERTS, ROWS, COLS)}}}
    s3_requests.clear()
    zarrckpt.load(target, url, storage_options=opts, allow_modified=True)
    assert torch.equal(target["model"]["experts"]["w1"], _expert_block(0, EXPERTS))
    manifest = [r for r in s3_requests.requests() if r.path == f"/{url[5:]}/zarr.json"]
    assert [(r.kind, r.range) for r in manifest] == [("GET", "bytes=0-"), ("GET", "bytes=0-65535")]


def test_a_save_replacing_the_checkpoint_mid_load_is_refused(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the manifest is read and before any chunk is: the chunks read now are the new save's,
    which fail the comparison with the commit record; the load says the checkpoint was replaced."""
    url, opts = unique_url("s3"), s3_storage_options(s3_server)
    zarrckpt.save({"model": {"experts": {"w1": _expert_block(0, EXPERTS)}}}, url, storage_options=opts)
    plan_requests = targets.plan_requests

    def replaced_first(*args: Any, **kwargs: Any) -> Any:
        new = {"model": {"experts": {"w1": _expert_block(0, EXPERTS) + 1}}}
        zarrckpt.save(new, url, storage_options=opts, overwrite=True)
        return plan_requests(*args, **kwargs)

    monkeypatch.setattr(targets, "plan_requests", replaced_first)
    target = {"model": {"experts": {"w1": torch.zeros(EXPERTS, ROWS, COLS)}}}
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="overwritten or deleted while it was being read"):
        zarrckpt.load(target, url, storage_options=opts)


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
    shard = [(r.kind, r.range) for r in s3_requests.requests() if r.path.endswith("/w/c.0.0")]
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
    fs.pipe_file(f"{root}/w/c.0.0", index + struct.pack("<I", crc32c.crc32c(index)) + body)
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
    from zarrckpt.storage.store import Storage

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
