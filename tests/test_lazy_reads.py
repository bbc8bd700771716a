"""Reads without the shard-index GET, on a real (moto) S3 server: request counts, and what the
checks they keep still catch.

With the commit record, the byte offsets of a shard zarrckpt wrote follow from the manifest:
whole chunks are fetched directly (each checked against its own and its committed crc32c), and a
partly read chunk is fetched with its stored crc32c (compared with the committed one) when that
saves the index GET. A check that fails fetches the index to tell a peer's rewrite from damage.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

import zarrckpt
from zarrckpt.errors import CorruptChunkError, ModifiedCheckpointError
from zarrckpt.format import integrity
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.layout import Box
from zarrckpt.plan.fetch import Request, plan_fetches
from zarrckpt.storage.caps import LOCAL_FILES, OBJECT_STORE
from zarrckpt.storage.remote import RemoteBackend
from zarrckpt.testing import RequestLog

ROWS, COLS = 512, 1024
ROW = COLS * 4  # bytes
CHUNK_ROWS = 64  # chunk_bytes=256 KiB: 8 inner chunks of [64, 1024] in one 2 MiB shard
HEAD = 16 * 8 + 4  # the shard index
CHUNK = CHUNK_ROWS * ROW + 4  # one stored inner chunk: elements and crc32c


def _full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def _save(url: str, opts: dict[str, Any]) -> None:
    zarrckpt.save({"w": _full()}, url, storage_options=opts, chunk_bytes=CHUNK_ROWS * ROW)


def _chunk_start(k: int) -> int:
    return HEAD + k * CHUNK


def _shard_gets(log: RequestLog, url: str) -> list[tuple[str, str | None]]:
    return [(r.kind, r.range) for r in log.requests(url) if r.path.endswith("/w/c.0.0")]


def _first_read_extra(log: RequestLog) -> None:
    """Besides its shard GETs, a tensor's first read makes exactly one request: the GET of its
    segment of the chunk checksum table (``w``'s 8 slots, the table's first 32 bytes), sent beside them."""
    extra = [(r.kind, r.path.rsplit("/", 1)[-1], r.range) for r in log.requests() if not r.path.endswith("/w/c.0.0")]
    assert extra == [("GET", integrity.TABLE, "bytes=0-31")]


# --- the plans (pure) ---


def _meta(chunk_rows: int, committed: bool) -> ArrayMeta:
    n = ROWS // chunk_rows
    table = b"\x01\x02\x03\x04" * n if committed else b""
    return ArrayMeta("w", (ROWS, COLS), "float32", (ROWS, COLS), (chunk_rows, COLS), committed_crc32c=table)


def _plan(meta: ArrayMeta, row: int, caps: Any = OBJECT_STORE) -> list[tuple[int, int | None, bool, tuple[int, ...]]]:
    box = Box((row, 0), (1, 5))
    (read,) = plan_fetches([Request(meta, box, np.empty((1, 5), np.float32))], caps, partial=True)
    return [(f.start, f.end, f.index, f.anchors) for f in read.fetches]


def test_plan_reads_a_pieces_crc32c_instead_of_the_index_when_that_saves_a_request() -> None:
    meta = _meta(CHUNK_ROWS, committed=True)
    start = _chunk_start(1) + 36 * ROW  # row 100: row 36 of chunk 1, 108 KiB before the chunk's crc32c
    assert _plan(meta, 100) == [(start, _chunk_start(2), False, (1,))]


def test_plan_reads_through_to_a_far_crc32c_keeps_the_index_only_without_the_record() -> None:
    """A partly read chunk always comes with a proof that it is the committed chunk: its stored crc32c
    read through in the same GET, however far (the index cannot tell two shards of one layout apart);
    read whole when the first needed byte lies in its first half; the index only without a record;
    on local files, whole and verified."""
    big = _meta(256, committed=True)  # 1 MiB chunks
    head, chunk = 16 * 2 + 4, 256 * ROW + 4
    assert _plan(big, 300) == [(head + chunk, head + 2 * chunk, False, ())]  # row 44 of chunk 1: read whole
    far = head + chunk + 194 * ROW  # row 450, row 194 of chunk 1: 248 KiB before its crc32c
    assert _plan(big, 450) == [(far, head + 2 * chunk, False, (1,))]
    assert _plan(_meta(CHUNK_ROWS, committed=False), 100) == [  # no commit record: the index proves the layout
        (0, HEAD, True, ()),
        (_chunk_start(1) + 36 * ROW, _chunk_start(1) + 36 * ROW + 20, False, ()),
    ]
    local = _plan(_meta(CHUNK_ROWS, committed=True), 100, LOCAL_FILES)
    assert local == [(0, HEAD, True, ()), (_chunk_start(1), _chunk_start(2), False, ())]  # chunk 1 whole
    assert _plan(_meta(CHUNK_ROWS, committed=True), 3) == [(_chunk_start(0), _chunk_start(1), False, ())]


# --- at the server ---


def test_a_partial_lazy_read_is_one_get_with_its_chunks_crc32c(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog
) -> None:
    url, opts = s3_url
    _save(url, opts)
    view = zarrckpt.open(url, storage_options=opts)["w"]
    s3_requests.clear()
    assert torch.equal(view[100, :5], _full()[100, :5])
    start = _chunk_start(1) + 36 * ROW
    assert _shard_gets(s3_requests, url) == [("GET", f"bytes={start}-{_chunk_start(2) - 1}")]
    _first_read_extra(s3_requests)
    s3_requests.clear()
    assert torch.equal(view[101, :5], _full()[101, :5])  # its checksums known: one GET
    assert len(s3_requests.requests()) == 1


def test_a_lazy_read_of_whole_chunks_is_one_get_without_the_index(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog
) -> None:
    url, opts = s3_url
    _save(url, opts)
    view = zarrckpt.open(url, storage_options=opts)["w"]
    s3_requests.clear()
    assert torch.equal(view[64:192], _full()[64:192])  # chunks 1 and 2, each checked whole
    assert _shard_gets(s3_requests, url) == [("GET", f"bytes={_chunk_start(1)}-{_chunk_start(3) - 1}")]
    _first_read_extra(s3_requests)


def _zarr_array(url: str, opts: dict[str, Any], **config: Any) -> Any:
    zarr = pytest.importorskip("zarr")
    return zarr.open_array(f"{url}/w", mode="r+", storage_options=opts, zarr_format=3, config=config)


def test_a_peer_dropping_a_chunk_is_caught_by_a_partial_read(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog
) -> None:
    """zarr-python zeroes rows 0:64 and drops that all-fill chunk: every later chunk moves up by
    one. Read at the committed offsets, row 100 would be row 164's bytes; the stored crc32c at
    the committed place is not chunk 1's, the index then shows the new layout."""
    url, opts = s3_url
    _save(url, opts)
    arr = _zarr_array(url, opts, write_empty_chunks=False)
    arr[0:CHUNK_ROWS] = 0.0
    fs, root = fsspec.core.url_to_fs(url, **opts)
    assert fs.size(f"{root}/w/c.0.0") == HEAD + 7 * CHUNK  # really dropped
    s3_requests.clear()
    with pytest.raises(ModifiedCheckpointError, match="not laid out as zarrckpt wrote it"):
        zarrckpt.open(url, storage_options=opts)["w"][100, :5]
    start = _chunk_start(1) + 36 * ROW
    assert _shard_gets(s3_requests, url) == [
        ("GET", f"bytes={start}-{_chunk_start(2) - 1}"),
        ("GET", f"bytes=0-{HEAD - 1}"),  # the index, fetched to explain
    ]
    peer = zarrckpt.open(url, storage_options=opts, allow_modified=True)["w"]
    assert torch.equal(peer[100, :5], _full()[100, :5])
    assert torch.equal(peer[3, :5], torch.zeros(5))


def test_a_peer_rewrite_in_place_is_caught_by_a_partial_read(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog
) -> None:
    """zarr-python changes one element of chunk 1: the layout (and the index) stay as they were,
    so only the chunk's crc32c shows it; a partial read that reads it refuses the chunk."""
    url, opts = s3_url
    _save(url, opts)
    arr = _zarr_array(url, opts)
    arr[110, 7] = -1.0
    s3_requests.clear()
    with pytest.raises(ModifiedCheckpointError, match="modified after commit by another writer") as err:
        zarrckpt.open(url, storage_options=opts)["w"][100, :5]
    assert err.value.key == "w" and "w/c.0.0" in (err.value.chunk or "")
    assert len(_shard_gets(s3_requests, url)) == 2  # the read, then the index (layout unchanged)
    peer = zarrckpt.open(url, storage_options=opts, allow_modified=True)["w"]
    assert peer[110, 7].item() == -1.0 and torch.equal(peer[100, :5], _full()[100, :5])


def test_a_truncated_shard_read_without_the_index_is_reported(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog
) -> None:
    url, opts = s3_url
    _save(url, opts)
    fs, root = fsspec.core.url_to_fs(url, **opts)
    shard = fs.cat_file(f"{root}/w/c.0.0")
    fs.pipe_file(f"{root}/w/c.0.0", shard[: _chunk_start(7) + 52 * ROW + 8])  # cut inside the bytes of row 500
    s3_requests.clear()
    with pytest.raises(CorruptChunkError, match="truncated") as err:
        zarrckpt.open(url, storage_options=opts)["w"][500, :5]
    assert not isinstance(err.value, ModifiedCheckpointError)  # the index still says zarrckpt's layout
    assert len(_shard_gets(s3_requests, url)) == 2


def _load_columns(url: str, opts: dict[str, Any], rows: int, cols: int) -> torch.Tensor:
    target = {"w": zarrckpt.LocalShard(torch.zeros(rows, cols // 2), (rows, cols), (0, 0))}
    zarrckpt.load(target, url, storage_options=opts)
    return target["w"].data


def _save_rows(url: str, opts: dict[str, Any], rows: int, cols: int) -> torch.Tensor:
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    zarrckpt.save({"w": full}, url, storage_options=opts, chunk_bytes=64 * 1024)
    assert zarrckpt.open(url, storage_options=opts)["w"].meta.chunk_shape == (1, 16384)  # 4 inner chunks per row
    return full


def test_a_load_reads_through_small_gaps(s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog) -> None:
    """Rows longer than an inner chunk: the left half of every row is a run of 2 chunks, 16 runs in
    the one shard, 2 chunks (256 KiB) apart: far less than a request is worth
    (READ_THROUGH_BYTES), so one ranged GET from the first needed chunk to the last, no index GET."""
    url, opts = s3_url
    rows, cols = 16, 65536
    full = _save_rows(url, opts, rows, cols)
    s3_requests.clear()
    assert torch.equal(_load_columns(url, opts, rows, cols), full[:, : cols // 2])
    chunk, head = 16384 * 4 + 4, 16 * 64 + 4
    assert _shard_gets(s3_requests, url) == [("GET", f"bytes={head}-{head + (4 * (rows - 1) + 2) * chunk - 1}")]


def test_a_load_gets_one_request_per_run_past_the_gap(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With gaps wider than READ_THROUGH_BYTES (made small here), each run is a ranged GET of its own:
    16 GETs, no index GET, exactly the needed chunks' bytes."""
    monkeypatch.setattr(RemoteBackend, "caps", replace(OBJECT_STORE, read_through_bytes=64 * 1024))
    url, opts = s3_url
    rows, cols = 16, 65536
    full = _save_rows(url, opts, rows, cols)
    s3_requests.clear()
    assert torch.equal(_load_columns(url, opts, rows, cols), full[:, : cols // 2])
    gets = _shard_gets(s3_requests, url)
    chunk, head = 16384 * 4 + 4, 16 * 64 + 4
    assert sorted(gets) == sorted(
        ("GET", f"bytes={head + 4 * r * chunk}-{head + (4 * r + 2) * chunk - 1}") for r in range(rows)
    )
    assert sum(r.bytes_sent for r in s3_requests.requests(url) if r.path.endswith("/w/c.0.0")) == rows * 2 * chunk


# --- whole loads on object stores: request size and read-through gaps (pure) ---


def _expert_meta() -> ArrayMeta:
    """The scale model's expert shard: 2 experts x [2560, 1280] float32 (26.2 MB), 4 MiB inner chunks."""
    shape = (2, 2560, 1280)
    chunk = (1, 640, 1280)  # 3.3 MB: 8 chunks
    return ArrayMeta("e", shape, "float32", shape, chunk, committed_crc32c=b"\0" * 4 * 8)


def _load_plan(meta: ArrayMeta, box: Box, caps: Any = OBJECT_STORE) -> list[tuple[int, int | None, tuple[int, ...]]]:
    (read,) = plan_fetches([Request(meta, box, np.empty(box.sizes, np.float32))], caps)
    return [(f.start, f.end, f.chunks) for f in read.fetches]


def test_a_whole_object_over_8_mib_is_one_get() -> None:
    meta = _expert_meta()
    assert _load_plan(meta, Box.full(meta.shape)) == [(0, None, tuple(range(8)))]


def test_two_runs_a_quarter_apart_are_one_get_through_the_gap() -> None:
    """A shrink from EP-DP 2 to 4: half of each expert's rows, two runs 6.5 MB apart -> one GET of 19.7 MB."""
    meta = _expert_meta()
    layout_head, chunk = 8 * 16 + 4, 640 * 1280 * 4 + 4
    plan = _load_plan(meta, Box((0, 0, 0), (2, 1280, 1280)))
    assert plan == [(layout_head, layout_head + 6 * chunk, (0, 1, 4, 5))]
    # past the gap worth a request, or past the request size: two GETs, the bytes needed only
    for caps in (
        replace(OBJECT_STORE, read_through_bytes=2 * chunk - 1),
        replace(OBJECT_STORE, max_request_bytes=4 * chunk),
    ):
        assert _load_plan(meta, Box((0, 0, 0), (2, 1280, 1280)), caps) == [
            (layout_head, layout_head + 2 * chunk, (0, 1)),
            (layout_head + 4 * chunk, layout_head + 6 * chunk, (4, 5)),
        ]


def test_local_files_never_read_through_a_gap() -> None:
    meta = _expert_meta()
    head, chunk = 8 * 16 + 4, 640 * 1280 * 4 + 4
    plan = _load_plan(meta, Box((0, 0, 0), (2, 1280, 1280)), LOCAL_FILES)
    # the index and the run right behind it in one read (no gap between them)
    assert [(s, e) for s, e, _ in plan] == [(0, head + 2 * chunk), (head + 4 * chunk, head + 6 * chunk)]


def test_partly_needed_chunks_that_arrive_whole_are_checked(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog
) -> None:
    """Row 10 of each of 8 experts (``e[:, 10, :5]``, one 256 KiB inner chunk per expert): each
    row lies in the first half of its chunk, so every chunk is read whole (here the whole shard
    object, in one GET) and checked by its crc32c: a flipped byte in expert 3, outside the rows
    read, is an error rather than unread."""
    url, opts = s3_url
    experts = torch.arange(8 * 64 * 1024, dtype=torch.float32).reshape(8, 64, 1024)
    zarrckpt.save({"e": experts}, url, storage_options=opts)
    view = zarrckpt.open(url, storage_options=opts)["e"]
    assert view.meta.chunk_shape == (1, 64, 1024)
    head, chunk = 8 * 16 + 4, 64 * ROW + 4
    s3_requests.clear()
    assert torch.equal(view[:, 10, :5], experts[:, 10, :5])
    shard = [(r.kind, r.range) for r in s3_requests.requests(url) if r.path.endswith("/e/c.0.0.0")]
    assert shard == [("GET", "bytes=0-")]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    raw = bytearray(fs.cat_file(f"{root}/e/c.0.0.0"))
    raw[head + 3 * chunk + 20 * ROW] ^= 0xFF
    fs.pipe_file(f"{root}/e/c.0.0.0", bytes(raw))
    with pytest.raises(CorruptChunkError, match="crc32c"):
        zarrckpt.open(url, storage_options=opts)["e"][:, 10, :5]
