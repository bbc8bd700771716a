"""Partial inner-chunk reads: the byte-range math against numpy, and the reader on arbitrary layouts."""

from __future__ import annotations

import itertools
import math
import uuid
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zarrckpt
from zarrckpt import cli
from zarrckpt.engine.reader import Request, read_regions
from zarrckpt.errors import CorruptChunkError
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.layout import Box, cell_box, cells_in
from zarrckpt.format.shard import encode_shard
from zarrckpt.plan import fetch
from zarrckpt.plan.ranges import chunk_ranges, merge_ranges
from zarrckpt.storage.store import Storage
from zarrckpt.tensorview import UncheckedReadWarning


@st.composite
def chunk_and_box(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    chunk = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=4)))
    offsets, sizes = [], []
    for n in chunk:
        lo = draw(st.integers(0, n - 1))
        offsets.append(lo)
        sizes.append(draw(st.integers(1, n - lo)))
    return chunk, tuple(offsets), tuple(sizes)


def _needed_bytes(chunk: tuple[int, ...], itemsize: int, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> set[int]:
    """Byte positions of the box's elements, by numpy slicing of the chunk's flat element numbers."""
    flat = np.arange(math.prod(chunk)).reshape(chunk)
    elements = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].ravel()
    return {int(e) * itemsize + b for e in elements for b in range(itemsize)}


@given(chunk_and_box(), st.sampled_from([1, 2, 4, 8]), st.sampled_from([0, 1, 3, 8, 50, 10**9]))
@settings(max_examples=300, deadline=None)
def test_chunk_ranges_cover_exactly_what_numpy_slices(box: Any, itemsize: int, gap: int) -> None:
    chunk, offsets, sizes = box
    ranges = chunk_ranges(chunk, itemsize, offsets, sizes, gap, limit=10**9)
    assert ranges is not None
    needed = _needed_bytes(chunk, itemsize, offsets, sizes)
    covered = {b for s, e in ranges for b in range(s, e)}
    assert needed <= covered and sum(e - s for s, e in ranges) == len(covered)  # covers, no overlap
    assert all(s in needed and e - 1 in needed for s, e in ranges)  # no wasted bytes at the ends
    assert all(a[1] + gap < b[0] for a, b in itertools.pairwise(ranges))  # sorted, maximally merged
    if gap == 0:
        assert covered == needed
    if len(ranges) > 1:
        assert chunk_ranges(chunk, itemsize, offsets, sizes, gap, limit=len(ranges) - 1) is None


def test_chunk_ranges_examples() -> None:
    # [8, 256, 256] float32: expert 5 is one 256 KiB run; row 17 of it one 1 KiB run
    assert chunk_ranges((8, 256, 256), 4, (5, 0, 0), (1, 256, 256), 0, 1) == [(5 << 18, 6 << 18)]
    assert chunk_ranges((8, 256, 256), 4, (5, 17, 0), (1, 1, 256), 0, 1) == [
        ((5 << 18) + 17 * 1024, (5 << 18) + 18 * 1024)
    ]
    # a column: 4 runs of one element, 12 bytes apart; merged when the gap allows
    assert chunk_ranges((4, 4), 4, (0, 1), (4, 1), 11, 10) == [(4, 8), (20, 24), (36, 40), (52, 56)]
    assert chunk_ranges((4, 4), 4, (0, 1), (4, 1), 12, 10) == [(4, 56)]
    assert chunk_ranges((), 8, (), (), 0, 1) == [(0, 8)]
    assert chunk_ranges((3, 0), 4, (0, 0), (3, 0), 0, 1) == []


@given(
    st.lists(st.tuples(st.integers(0, 200), st.integers(1, 40)), max_size=12),
    st.integers(0, 30),
    st.integers(1, 100),
)
@settings(max_examples=300, deadline=None)
def test_merge_ranges(raw: list[tuple[int, int]], gap: int, max_bytes: int) -> None:
    ranges = [(s, s + n) for s, n in raw]
    spans = merge_ranges(ranges, gap, max_bytes)
    assert sorted(i for _, _, members in spans for i in members) == list(range(len(ranges)))
    for start, end, members in spans:
        assert start == min(ranges[i][0] for i in members) and end == max(ranges[i][1] for i in members)
        assert [ranges[i] for i in members] == sorted(ranges[i] for i in members)
        reach, overlapped = ranges[members[0]][1], False
        for i in members[1:]:
            overlapped |= ranges[i][0] < reach
            reach = max(reach, ranges[i][1])
        assert overlapped or len(members) == 1 or end - start <= max_bytes  # only overlaps exceed max_bytes
    for (start, end, _), (nxt, _, members) in itertools.pairwise(spans):
        first = ranges[members[0]]
        assert nxt >= end  # disjoint and sorted
        assert nxt - end > gap or max(end, first[1]) - start > max_bytes  # split for the gap or for the size
    assert merge_ranges([(0, 4), (6, 9), (40, 41)], 2, 100) == [(0, 9, [0, 1]), (40, 41, [2])]
    assert merge_ranges([(0, 4), (6, 9)], 2, 8) == [(0, 4, [0]), (6, 9, [1])]
    assert merge_ranges([(5, 9), (0, 20)], 0, 4) == [(0, 20, [1, 0])]


# -- the reader: any layout (edge shards, several chunks per shard), any box, partial vs whole -------


@st.composite
def layout_and_boxes(draw: st.DrawFn) -> tuple[Any, ...]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    shard = tuple(draw(st.integers(1, n)) for n in shape)
    chunk = tuple(draw(st.sampled_from([d for d in range(1, s + 1) if s % d == 0])) for s in shard)
    boxes = []
    for _ in range(draw(st.integers(1, 2))):  # two requests may need parts of the same chunk
        offsets, sizes = [], []
        for n in shape:
            lo = draw(st.integers(0, n - 1))
            offsets.append(lo)
            sizes.append(draw(st.integers(1, n - lo)))
        boxes.append(Box(tuple(offsets), tuple(sizes)))
    gap = draw(st.sampled_from([0, 4, 64, 1 << 20]))
    return shape, shard, chunk, boxes, gap


@given(layout_and_boxes(), st.sampled_from(["float32", "int16", "float64"]))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_partial_reads_match_numpy(monkeypatch: pytest.MonkeyPatch, case: Any, dtype: str) -> None:
    shape, shard, chunk, boxes, gap = case
    full = np.arange(math.prod(shape)).astype(dtype).reshape(shape)
    storage = Storage(f"memory://{uuid.uuid4().hex}")
    meta = ArrayMeta("w", shape, dtype, shard, chunk)
    for idx in cells_in(Box.full(shape), shard):
        storage.write(meta.shard_path(idx), encode_shard(full[cell_box(idx, shard, shape).slices()], shard, chunk))
    monkeypatch.setattr(fetch, "RANGE_MERGE_GAP", gap)
    for partial in (True, False):
        dests = [np.full(box.sizes, -1, dtype=dtype) for box in boxes]
        read_regions(storage, [Request(meta, b, d) for b, d in zip(boxes, dests, strict=True)], partial=partial)
        for box, dest in zip(boxes, dests, strict=True):
            assert np.array_equal(dest, full[box.slices()])
    storage.delete_all()


def test_whole_chunks_stay_verified_partial_ones_cannot_be(tmp_path: Any) -> None:
    """Rows 0:4 of 9, chunks of 3, on an object store without a commit record: chunk 0 is read whole
    (and verified), chunk 1 only for row 3, proven by the index alone. On local files a partly
    needed chunk is read whole, so the same flip is caught there."""
    full = np.arange(9, dtype="float32")
    meta = ArrayMeta("w", (9,), "float32", (9,), (3,))
    head = 16 * 3 + 4

    def read(storage: Storage, partial: bool) -> tuple[int, np.ndarray]:
        dest = np.empty(4, "float32")
        return read_regions(storage, [Request(meta, Box((0,), (4,)), dest)], partial=partial), dest

    remote, local = Storage(f"memory://{uuid.uuid4().hex}"), Storage(str(tmp_path / "ck"))
    raw = bytearray(b"".join(bytes(p) for p in encode_shard(full, (9,), (3,))))
    for storage in (remote, local):
        storage.write(meta.shard_path((0,)), [bytes(raw)])
    assert read(remote, True)[0] == head + 16 + 4  # one read: the index, chunk 0 + its crc, row 3
    assert read(remote, False)[0] == head + 3 * 16  # a small object: one GET of all of it
    assert read(local, True)[0] == head + 2 * 16  # local files: chunk 1 whole too
    assert np.array_equal(read(remote, True)[1], full[:4])
    raw[head + 16 + 8] ^= 0xFF  # row 5: in chunk 1, but not a byte the partial read fetches
    for storage in (remote, local):
        storage.write(meta.shard_path((0,)), [bytes(raw)])
    assert np.array_equal(read(remote, True)[1], full[:4])  # undetected: a partial read cannot check chunk 1's crc
    for storage, partial in ((remote, False), (local, True), (local, False)):
        with pytest.raises(CorruptChunkError, match=r"inner chunk \[1\].*crc32c"):
            read(storage, partial)
    raw[head + 4] ^= 0xFF  # row 1, in chunk 0: read whole, so verified even with partial reads
    remote.write(meta.shard_path((0,)), [bytes(raw)])
    with pytest.raises(CorruptChunkError, match=r"inner chunk \[0\].*crc32c"):
        read(remote, True)


# -- what a lazy view says about values it could not check, and `zarrckpt show`, which checks them ------
ROWS, COLS = 512, 1024  # 8 inner chunks of [64, 1024] (256 KiB) in one shard


def _saved_lazily(url: str) -> torch.Tensor:
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    zarrckpt.save({"w": full}, url, chunk_bytes=64 * COLS * 4)
    return full


def test_a_partial_lazy_read_says_its_values_were_not_checked(tmp_path: Any) -> None:
    """Row 100 lies in the second half of inner chunk 1 (rows 64:128): an object store reads it in
    part, with the chunk's stored crc32c, so nothing checks those values; the read warns, naming
    the tensor, the chunk and the way to checked values. Reads of whole chunks, reads with
    partial_reads=False and reads of local files (partly needed chunks read whole) check every
    value and say nothing."""
    url = f"memory://{uuid.uuid4().hex}/ck"
    full = _saved_lazily(url)
    view = zarrckpt.open(url)["w"]
    with pytest.warns(UncheckedReadWarning, match=r"'w': values were read from part of an inner chunk") as got:
        assert torch.equal(view[100, :5], full[100, :5])
    (warning,) = got
    assert "partial_reads=False" in str(warning.message) and "zarrckpt show" in str(warning.message)
    assert isinstance(warning.message, UncheckedReadWarning)
    assert [(where.split("/ck/")[1], used) for where, used, _ in warning.message.partly] == [
        ("w/c.0.0 (inner chunk [1, 0])", 5 * 4)
    ]
    assert warning.filename == __file__  # said where the caller indexed the view
    local = str(tmp_path / "ck")
    _saved_lazily(local)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(view[64:128], full[64:128])  # whole chunks
        assert np.array_equal(view.numpy((3, slice(0, 5))), full[3, :5].numpy())  # first half: the chunk whole
        assert torch.equal(zarrckpt.open(url, partial_reads=False)["w"][100, :5], full[100, :5])
        assert torch.equal(zarrckpt.open(local)["w"][100, :5], full[100, :5])


def test_show_prints_only_checked_values(capsys: pytest.CaptureFixture[str]) -> None:
    """A flipped bit in the first half of chunk 1, which a lazy read of row 100 does not read: the
    lazy read returns row 100 (and warns); `zarrckpt show` reads the chunk whole, and refuses."""
    url = f"memory://{uuid.uuid4().hex}/ck"
    full = _saved_lazily(url)
    storage = Storage(url)
    raw = bytearray(storage.read("w/c.0.0"))
    chunk = 64 * COLS * 4 + 4
    raw[16 * 8 + 4 + chunk + 10 * COLS * 4] ^= 0x01  # row 74, in chunk 1's first half
    storage.write("w/c.0.0", [bytes(raw)])
    with pytest.warns(UncheckedReadWarning):
        assert torch.equal(zarrckpt.open(url)["w"][100, :5], full[100, :5])
    assert cli.main(["show", url, "w[100, :5]"]) != 0
    out, err = capsys.readouterr()
    assert "inner chunk [1, 0]) of 'w' fails its crc32c checksum" in err and "tensor(" not in out
    assert "bad slice" not in err  # the data failed, not the slice
    assert cli.main(["show", url, "w[3, :5]"]) == 0  # chunk 0: whole, and intact
    assert "tensor([3072., 3073., 3074., 3075., 3076.])" in capsys.readouterr().out
