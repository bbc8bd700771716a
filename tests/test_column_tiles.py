"""Column tiles (``save(..., chunk_policy="tiles")``, FORMAT.md §4): the rule's shapes (pure), and
what a lazy column slice of a row-sharded matrix reads with them and without, on local disk and on
S3 (moto); zarr-python and TensorStore read the tiled array."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zarrckpt
from zarrckpt.errors import ZarrckptError
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.layout import (
    COLUMN_TILES,
    MIN_TILE_BYTES,
    Box,
    ChunkRule,
    chunk_rule,
    inner_chunk_shape,
)
from zarrckpt.plan.fetch import Request, lazy_caps, plan_fetches
from zarrckpt.plan.save import DEFAULT_CHUNK_BYTES
from zarrckpt.storage.caps import LOCAL_FILES, OBJECT_STORE
from zarrckpt.testing import spawn

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MiB = 1024 * 1024
TILES = ChunkRule(DEFAULT_CHUNK_BYTES, "tiles")


# -- the rule (pure) ------------------------------------------------------------------------------


@SETTINGS
@given(st.integers(1, 20_000), st.integers(1, 20_000), st.sampled_from([1, 2, 4, 8]), st.integers(1, 16 * MiB))
def test_tiles_divide_the_shard_keep_the_rows_and_bound_the_bytes(rows: int, cols: int, itemsize: int, target: int):
    shard = (rows, cols)
    band = inner_chunk_shape(shard, itemsize, target)
    tile = inner_chunk_shape(shard, itemsize, ChunkRule(target, "tiles"))
    assert tile[0] == band[0]  # a reshard across rows reads what it did
    assert cols % tile[1] == 0
    if tile != band:
        assert band[1] == cols  # only row bands as wide as the shard are cut
        nbytes = tile[0] * tile[1] * itemsize
        assert MIN_TILE_BYTES <= nbytes < tile[0] * cols * itemsize
        assert cols // tile[1] <= COLUMN_TILES
    elif band[1] == cols and band[0] * cols * itemsize >= 2 * MIN_TILE_BYTES:
        tiles = min(COLUMN_TILES, band[0] * cols * itemsize // MIN_TILE_BYTES)  # as many as the band's bytes allow
        assert all(cols % c for c in range(-(-cols // tiles), cols))  # no divisor to cut at


@SETTINGS
@given(st.lists(st.integers(1, 300), min_size=0, max_size=4).filter(lambda s: len(s) != 2), st.integers(1, 16 * MiB))
def test_tiles_leave_other_than_2d_shards_as_they_were(shard: list[int], target: int) -> None:
    assert inner_chunk_shape(tuple(shard), 4, ChunkRule(target, "tiles")) == inner_chunk_shape(tuple(shard), 4, target)


def test_tile_examples() -> None:
    assert inner_chunk_shape((1024, 4096), 4, TILES) == (128, 512)  # 2 MiB bands, 8 tiles of 256 KiB
    assert inner_chunk_shape((2048, 8192), 4, TILES) == (128, 1024)  # 4 MiB bands, 8 tiles of 512 KiB
    assert inner_chunk_shape((2048, 8192), 4, DEFAULT_CHUNK_BYTES) == (128, 8192)  # the default: bands
    assert inner_chunk_shape((1664, 832), 4, TILES) == (208, 416)  # 676 KiB bands: 2 tiles of 338 KiB
    assert inner_chunk_shape((832, 832), 4, TILES) == (104, 832)  # bands of 338 KiB: not cut
    assert inner_chunk_shape((1024, 4099), 4, TILES) == (128, 4099)  # a prime width stays whole
    assert inner_chunk_shape((64, 256, 256), 4, TILES) == (1, 256, 256)  # one expert per chunk, as before
    assert inner_chunk_shape((1 << 22,), 4, TILES) == inner_chunk_shape((1 << 22,), 4, DEFAULT_CHUNK_BYTES)


def test_the_default_policy_plans_with_the_plain_byte_target() -> None:
    assert chunk_rule(DEFAULT_CHUNK_BYTES, "rows") == DEFAULT_CHUNK_BYTES  # default plans as they were
    assert chunk_rule(DEFAULT_CHUNK_BYTES, "tiles") == TILES
    with pytest.raises(ZarrckptError, match="chunk_policy must be one of 'rows', 'tiles', not 'squares'"):
        chunk_rule(DEFAULT_CHUNK_BYTES, "squares")
    with pytest.raises(ZarrckptError, match="chunk_policy"):
        zarrckpt.save({"w": torch.zeros(4)}, "memory://never-written", chunk_policy="squares")


def _planned(chunk: tuple[int, int], box: Box, caps: Any, lazy: bool) -> tuple[int, int]:
    """(bytes, requests) the read planner fetches for ``box`` of a [4096, 4096] float32 matrix
    saved by 4 ranks, Shard(0), with committed crc32c (no index GETs)."""
    meta = ArrayMeta("w", (4096, 4096), "float32", (1024, 4096), chunk, committed_crc32c=b"\0" * 4)
    reads = plan_fetches([Request(meta, box, np.empty(box.sizes, np.float32))], lazy_caps(caps) if lazy else caps)
    return sum(r.nbytes for r in reads), sum(len(r.fetches) for r in reads)


def test_a_lazy_column_slice_reads_one_tile_per_band_and_a_reshard_the_same_bytes() -> None:
    band, tile = inner_chunk_shape((1024, 4096), 4, DEFAULT_CHUNK_BYTES), inner_chunk_shape((1024, 4096), 4, TILES)
    column = Box((0, 0), (4096, 16))
    for caps in (LOCAL_FILES, OBJECT_STORE):
        assert _planned(band, column, caps, lazy=True)[0] >= 64 * MiB  # every band: the whole matrix
        got, requests = _planned(tile, column, caps, lazy=True)  # 32 tiles of 256 KiB (local: + 4 indexes)
        assert requests == 32 and 32 * (256 * 1024 + 4) <= got <= 32 * (256 * 1024 + 4) + 4 * (16 * 64 + 4)
    # a load reads through gaps of up to 8 MiB on object stores (fewer requests): the whole shards
    assert _planned(tile, column, OBJECT_STORE, lazy=False)[0] >= 56 * MiB
    for caps in (LOCAL_FILES, OBJECT_STORE):  # a 4 -> 3 reshard: the same bytes either way
        for rank in range(3):
            lo, hi = rank * 1366, min(4096, (rank + 1) * 1366)
            rows = Box((lo, 0), (hi - lo, 4096))
            assert _planned(tile, rows, caps, lazy=False)[0] - _planned(band, rows, caps, lazy=False)[0] < 64 * 1024


# -- on storage -----------------------------------------------------------------------------------

ROWS, COLS = 2048, 4096  # 32 MiB float32, 2 ranks: shards of [1024, 4096], bands of [128, 4096]


def _matrix(lo: int, hi: int) -> torch.Tensor:
    return torch.arange(lo * COLS, hi * COLS, dtype=torch.float32).reshape(hi - lo, COLS)


def _save_both(rank: int, world: int, urls: dict[str, str], opts: dict[str, Any] | None) -> None:
    lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
    for policy, url in urls.items():
        part = zarrckpt.LocalShard(_matrix(lo, hi), (ROWS, COLS), (lo, 0))
        zarrckpt.save({"w": part}, url, storage_options=opts, chunk_policy=policy)


def _column_read(url: str, opts: dict[str, Any] | None) -> int:
    ckpt = zarrckpt.open(url, storage_options=opts)
    before = ckpt.stats()["bytes_read"]
    got = ckpt["w"][:, :16]
    assert torch.equal(got, _matrix(0, ROWS)[:, :16])
    return ckpt.stats()["bytes_read"] - before


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[dict[str, str], dict[str, Any] | None]:
    if request.param == "local":
        return {p: str(tmp_path / p) for p in ("rows", "tiles")}, None
    url, opts = request.getfixturevalue("s3_url")
    return {p: f"{url}/{p}" for p in ("rows", "tiles")}, opts


@pytest.mark.slow
def test_a_lazy_column_slice_of_a_row_sharded_matrix_reads_an_eighth_with_tiles(
    where: tuple[dict[str, str], dict[str, Any] | None],
) -> None:
    urls, opts = where
    spawn(2, _save_both, urls, opts)
    whole = ROWS * COLS * 4
    assert _column_read(urls["rows"], opts) >= whole  # every band of every shard
    index = 16 * 64 + 4  # a shard's index (read on local disk; on S3 the commit record stands in)
    segment = 4 * 2 * 64  # the tensor's committed crc32c, one per inner chunk of its 2 shards (a first read)
    assert _column_read(urls["tiles"], opts) <= whole // COLUMN_TILES + 16 * 4 + 2 * index + segment  # a tile per band
    tiled = zarrckpt.open(urls["tiles"], storage_options=opts)
    assert tiled.manifest.arrays["w"].chunk_shape == (128, 512)
    target = {"w": zarrckpt.LocalShard(torch.empty(683, COLS), (ROWS, COLS), (683, 0))}  # another layout
    zarrckpt.load(target, urls["tiles"], storage_options=opts)
    assert torch.equal(target["w"].data, _matrix(683, 1366))
    if opts is None:  # peer readers take the tiles from zarr.json
        zarr = pytest.importorskip("zarr")
        ts = pytest.importorskip("tensorstore")
        path = f"{urls['tiles']}/w"
        assert np.array_equal(zarr.open_array(path, mode="r", zarr_format=3)[:, :16], _matrix(0, ROWS)[:, :16].numpy())
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}
        got = ts.open(spec, read=True).result()[:, 500:530].read().result()
        assert np.array_equal(got, _matrix(0, ROWS)[:, 500:530].numpy())
        assert math.prod(zarr.open_array(path, mode="r", zarr_format=3).chunks) == 128 * 512


def test_save_and_async_save_take_the_policy(tmp_path: Any) -> None:
    w = torch.arange(1024 * 4096, dtype=torch.float32).reshape(1024, 4096)  # one rank: one 16 MiB shard
    zarrckpt.save({"w": w}, str(tmp_path / "sync"), chunk_policy="tiles")
    zarrckpt.async_save({"w": w}, str(tmp_path / "async"), chunk_policy="tiles").result()
    zarrckpt.save({"w": w}, str(tmp_path / "default"))
    for name, chunk in (("sync", (128, 512)), ("async", (128, 512)), ("default", (128, 4096))):
        ckpt = zarrckpt.open(str(tmp_path / name))
        assert ckpt.manifest.arrays["w"].chunk_shape == chunk
        assert torch.equal(ckpt["w"][:, 1000:1010], w[:, 1000:1010])


def test_a_lazy_read_runs_a_shards_gets_apart_only_when_each_stands_alone() -> None:
    from zarrckpt.engine.reader import _apart
    from zarrckpt.format.shard import ShardLayout
    from zarrckpt.plan.fetch import Fetch, ShardRead, ShardTask

    meta = ArrayMeta("w", (1024, 4096), "float32", (1024, 4096), (128, 512), committed_crc32c=b"\0" * 4)
    task, layout = ShardTask(meta, (0, 0)), ShardLayout.of(meta, (0, 0))
    whole = ShardRead(task, layout, (Fetch(0, 10, chunks=(0,)), Fetch(20, 30, chunks=(8,))))
    assert [r.fetches for r in _apart(whole, lazy=True)] == [(whole.fetches[0],), (whole.fetches[1],)]
    assert _apart(whole, lazy=False) == [whole]  # a load keeps its order
    indexed = ShardRead(task, layout, (Fetch(0, 10, index=True, chunks=(0,)), Fetch(20, 30, chunks=(8,))))
    assert _apart(indexed, lazy=True) == [indexed]  # the index is checked before any chunk is used
    spanning = ShardRead(task, layout, (Fetch(0, 10, pieces=((0, 0, 4),)), Fetch(20, 30, pieces=((0, 8, 12),))))
    assert _apart(spanning, lazy=True) == [spanning]  # one chunk's pieces gathered across two reads
