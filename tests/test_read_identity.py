"""Every value a read returns comes from the committed object: a lazy read of any size detects a
shard object swapped with another of the same size, or replaced by the same tensor's shard of an
older checkpoint (same layout, so the shard index cannot tell them apart).

With the commit record (every inner chunk's crc32c as committed), a partly read chunk is fetched
through its own stored crc32c, compared with the committed one, in the same request (object
stores), or read whole and verified (local files). Chunks read whole are always compared.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zarrckpt
from zarrckpt.errors import ModifiedCheckpointError
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.layout import Box
from zarrckpt.plan.fetch import Request, plan_fetches
from zarrckpt.storage.caps import LOCAL_FILES, OBJECT_STORE
from zarrckpt.storage.store import Storage
from zarrckpt.testing import RequestLog

ROWS, COLS = 1024, 1024  # per shard: 4 MiB of float32, in 8 inner chunks of 128 rows (512 KiB)


@pytest.fixture(params=["local", "s3", "rgw", "gcs"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    if request.param == "local":
        yield str(tmp_path / "ck"), {}
    else:
        yield request.getfixturevalue(f"{request.param}_url")


def _halves(scale: float) -> dict[str, Any]:
    """One tensor of two same-size shard objects (rows 0:1024 and 1024:2048), values depending on ``scale``."""
    full = torch.arange(2 * ROWS * COLS, dtype=torch.float32).reshape(2 * ROWS, COLS) * scale
    parts = [
        zarrckpt.LocalShard(full[i * ROWS : (i + 1) * ROWS].clone(), (2 * ROWS, COLS), (i * ROWS, 0)) for i in (0, 1)
    ]
    return {"w": parts}


def _swap(url: str, opts: dict[str, Any], a: str, b: str) -> None:
    storage = Storage(url, opts)
    first, second = storage.read(a), storage.read(b)
    assert len(first) == len(second) and first != second
    storage.write(a, [second])
    storage.write(b, [first])


# Elements: near a chunk's start (read whole on local files and object stores: the rows before it are
# under half the chunk), far before its crc32c (1.6 MiB: read in part with it), next to the crc32c.
ELEMENTS = [(5, 17), (1624, 3), (2047, 1000)]


@pytest.mark.parametrize("element", ELEMENTS)
def test_lazy_reads_detect_two_swapped_shard_objects(
    where: tuple[str, dict[str, Any]], element: tuple[int, int]
) -> None:
    url, opts = where
    zarrckpt.save(_halves(1.0), url, storage_options=opts)
    _swap(url, opts, "w/c.0.0", "w/c.1.0")
    view = zarrckpt.open(url, storage_options=opts)["w"]
    with pytest.raises(ModifiedCheckpointError, match="was modified after commit"):
        view[element]
    with pytest.raises(ModifiedCheckpointError):  # the rows around it too
        view[element[0] : element[0] + 2, :5]


def test_lazy_reads_detect_a_shard_from_an_older_checkpoint(where: tuple[str, dict[str, Any]]) -> None:
    url, opts = where
    older, newer = f"{url}/step_1", f"{url}/step_2"
    zarrckpt.save(_halves(1.0), older, storage_options=opts)
    zarrckpt.save(_halves(2.0), newer, storage_options=opts)
    Storage(newer, opts).write("w/c.1.0", [Storage(older, opts).read("w/c.1.0")])  # restored from a backup, say
    view = zarrckpt.open(newer, storage_options=opts)["w"]
    assert float(view[5, 17]) == 2.0 * (5 * COLS + 17)  # the untouched shard still reads
    for row, col in [(1024 + 5, 17), (1624, 3), (2047, 1000)]:
        with pytest.raises(ModifiedCheckpointError):
            view[row, col]
    with pytest.raises(ModifiedCheckpointError):  # load and verify catch it too, as before
        zarrckpt.load({"w": torch.empty(2 * ROWS, COLS)}, newer, storage_options=opts)
    assert not zarrckpt.open(newer, storage_options=opts).verify().ok


def test_a_far_element_is_still_one_get_with_its_chunks_crc32c(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog
) -> None:
    """The price of the check on object stores: bytes, not requests. Row 1624 col 3 lies 160 KiB
    before its chunk's crc32c: one ranged GET from it through the crc32c."""
    url, opts = s3_url
    zarrckpt.save(_halves(1.0), url, storage_options=opts)
    view = zarrckpt.open(url, storage_options=opts)["w"]
    rows = view.meta.chunk_shape[0]
    assert view.meta.chunk_shape == (128, COLS)  # 8 inner chunks per shard
    s3_requests.clear()
    assert float(view[1624, 3]) == 1624 * COLS + 3
    head = 8 * 16 + 4  # the shard index: an entry per inner chunk, and its crc32c
    chunk = (1624 - ROWS) // rows  # the inner chunk holding row 1624; each before it: elements + crc32c
    base = head + chunk * (rows * COLS * 4 + 4)
    start = base + ((1624 - ROWS) % rows) * COLS * 4 + 3 * 4
    end = base + rows * COLS * 4 + 4  # through the chunk's crc32c
    gets = [(r.kind, r.path.rsplit("/", 1)[-1], r.range) for r in s3_requests.requests(url)]
    offset, nbytes, _ = view.meta.crc_segment
    segment = ("GET", ".zarrckpt-crc32c", f"bytes={offset}-{offset + nbytes - 1}")  # its first read: its checksums
    assert sorted(gets) == sorted([("GET", "c.1.0", f"bytes={start}-{end - 1}"), segment])


# --- the plans (pure): every partly read chunk carries a proof that it is the committed chunk ---


@st.composite
def _reads(draw: Any) -> tuple[ArrayMeta, Box]:
    ndim = draw(st.integers(1, 3))
    chunk = tuple(draw(st.integers(1, 16)) for _ in range(ndim))
    per_shard = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
    shard = tuple(c * n for c, n in zip(chunk, per_shard, strict=True))
    shape = tuple(draw(st.integers(1, 2 * s)) for s in shard)
    offsets = tuple(draw(st.integers(0, n - 1)) for n in shape)
    sizes = tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, offsets, strict=True))
    n_chunks = int(np.prod([-(-n // c) for n, c in zip(shape, chunk, strict=True)])) * 2
    meta = ArrayMeta("w", shape, "float32", shard, chunk, committed_crc32c=b"\0\0\0\0" * n_chunks * 64)
    return meta, Box(offsets, sizes)


@settings(max_examples=300, deadline=None)
@given(_reads(), st.sampled_from([OBJECT_STORE, LOCAL_FILES]))
def test_every_partly_read_chunk_is_fetched_with_its_crc32c(read: tuple[ArrayMeta, Box], caps: Any) -> None:
    meta, box = read
    dest = np.empty(box.sizes, np.float32)
    for shard_read in plan_fetches([Request(meta, box, dest)], caps, partial=True):
        for fetch in shard_read.fetches:
            partly = {k for k, _, _ in fetch.pieces}
            if caps is LOCAL_FILES:
                assert not partly, "local files: partly needed chunks are read whole"
            assert partly <= set(fetch.anchors), "a piece without its chunk's crc32c in the same read"


@settings(max_examples=300, deadline=None)
@given(_reads())
def test_on_local_files_every_chunk_a_request_takes_whole_is_read_straight_into_it(read: tuple[ArrayMeta, Box]) -> None:
    """A shard object holding several ranks' rows has chunks a rank needs in part at its edges: those
    are read apart, and the chunks between still go straight into the destination (one copy), not
    through a read buffer with the edges."""
    meta, box = read
    dest = np.empty(box.sizes, np.float32)
    for shard_read in plan_fetches([Request(meta, box, dest)], LOCAL_FILES):
        task, seen = shard_read.task, []
        for fetch in shard_read.fetches:
            views = [task.direct_view(k) is not None for k in fetch.chunks]
            assert all(views) if fetch.direct else not any(views), (fetch, views)
            seen += fetch.chunks
        assert sorted(seen) == sorted(task.needs), "every needed chunk read once"
