"""Read once, fan out: the planner (pure, checked by simulating its plans) and loads on gloo ranks
against the moto S3 server, whose own request log counts the bytes fetched."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import get_state_dict

import zarrckpt
from zarrckpt.engine import fanread
from zarrckpt.format.layout import Box, cell_box, cells_in
from zarrckpt.plan import fanout
from zarrckpt.plan.fanout import ArrayInfo, FanOutPlan
from zarrckpt.testing import RequestLog, spawn

Wants = list[list[tuple[int, Box]]]

# ---------------------------------------------------------------------------------------------
# the planner, simulated: "storage" is a numpy array per saved array, ranks are lists of buffers


def _chunks_read(info: ArrayInfo, region: Box, whole: int) -> set[tuple[int, ...]]:
    """The inner chunks a read of ``region`` fetches: those it touches, and all of each shard no
    larger than ``whole`` bytes that it touches (read whole, as zarrckpt.plan.fetch does)."""
    out = set(cells_in(region, info.chunk_shape))
    for shard in cells_in(region, info.shard_shape):
        cell = cell_box(shard, info.shard_shape, info.shape)
        if cell.volume * info.itemsize <= whole:
            out.update(cells_in(cell, info.chunk_shape))
    return out


def _simulate(
    wants: Wants, arrays: list[ArrayInfo], plan: FanOutPlan, whole: int = 0
) -> tuple[int, list[list[np.ndarray]]]:
    """Run ``plan`` in memory; returns the inner chunks fetched (per rank and round, each once; shards
    up to ``whole`` bytes read whole) and every rank's filled buffers. Checks that every element of
    every request is written exactly once."""
    stored = [np.arange(math.prod(a.shape), dtype=np.int64).reshape(a.shape) for a in arrays]
    dests = [[np.full(box.sizes, -1, dtype=np.int64) for _, box in reqs] for reqs in wants]
    writes = [[np.zeros(box.sizes, dtype=np.int64) for _, box in reqs] for reqs in wants]
    fetched: set[tuple[int, int, int, tuple[int, ...]]] = set()

    def fetch(rank: int, n: int, array: int, region: Box) -> np.ndarray:
        fetched.update((rank, n, array, c) for c in _chunks_read(arrays[array], region, whole))
        return stored[array][region.slices()].copy()

    def put(rank: int, slot: int, region: Box, data: np.ndarray) -> np.ndarray:
        box = wants[rank][slot][1]
        assert box.intersect(region) == region, "a region outside the request it lands in"
        where = region.relative_to(box.offsets).slices()
        dests[rank][slot][where] = data
        writes[rank][slot][where] += 1
        return dests[rank][slot][where]

    for rank, slots in enumerate(plan.solo):
        for slot in slots:
            array, box = wants[rank][slot]
            put(rank, slot, box, fetch(rank, 0, array, box))
    for rank, parts in enumerate(plan.solo_parts):
        for slot, region in parts:
            array, _ = wants[rank][slot]
            put(rank, slot, region, fetch(rank, 0, array, region))
    for n, rnd in enumerate(plan.rounds):
        held = {}
        for i, item in enumerate(rnd.items):
            data = fetch(item.reader, n, item.array, item.region)
            assert item.nbytes == item.region.volume * arrays[item.array].itemsize
            held[i] = put(item.reader, item.source, item.region, data) if item.source >= 0 else data
            for r, slot in item.targets:
                if r == item.reader:  # another request of the reader's, with the same box
                    put(r, slot, item.region, held[i])
        for msg in rnd.messages:
            assert all(rnd.items[i].reader == msg.src for i in msg.items)
            buf = np.concatenate([held[i].reshape(-1) for i in msg.items])
            assert sum(held[i].size * arrays[rnd.items[i].array].itemsize for i in msg.items) == msg.nbytes
            for dst in msg.dsts:
                at = 0
                for i in msg.items:
                    item = rnd.items[i]
                    assert dst in {r for r, _ in item.targets}, "a message to a rank that is no target"
                    for r, slot in item.targets:
                        if r == dst:
                            put(r, slot, item.region, buf[at : at + item.region.volume].reshape(item.region.sizes))
                    at += item.region.volume
        sent = {(i, d) for m in rnd.messages for i in m.items for d in m.dsts}
        want = {(i, r) for i, item in enumerate(rnd.items) for r, _ in item.targets if r != item.reader}
        assert sent == want, "a target not sent to, or the reader sending to itself"
    for rank, reqs in enumerate(wants):
        for slot, (array, box) in enumerate(reqs):
            assert (writes[rank][slot] == 1).all(), f"rank {rank} request {slot}: elements written not exactly once"
            np.testing.assert_array_equal(dests[rank][slot], stored[array][box.slices()])
    return len(fetched), dests


def _naive_chunks(wants: Wants, arrays: list[ArrayInfo], whole: int) -> int:
    """Inner chunks fetched when every rank reads its own requests."""
    return sum(len(_chunks_read(arrays[a], box, whole)) for reqs in wants for a, box in reqs)


@st.composite
def _problems(draw: st.DrawFn) -> tuple[Wants, list[ArrayInfo]]:
    arrays = []
    for _ in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(0, 2))
        shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
        chunks = tuple(draw(st.integers(1, max(1, n))) for n in shape)
        shards = tuple(c * draw(st.integers(1, 3)) for c in chunks)
        arrays.append(ArrayInfo(shape, shards, chunks, 8))
    world = draw(st.integers(1, 5))
    wants: Wants = [[] for _ in range(world)]
    for rank in range(world):
        for a, info in enumerate(arrays):
            choice = draw(st.sampled_from(["none", "box", "replica", "replica", "full"]))
            earlier = [box for reqs in wants[:rank] for b, box in reqs if b == a]
            if choice == "replica" and earlier:
                box = draw(st.sampled_from(earlier))
            elif choice == "full" or not info.shape:
                box = Box.full(info.shape)
            elif choice in ("box", "replica"):
                lo = [draw(st.integers(0, n - 1)) for n in info.shape]
                box = Box(tuple(lo), tuple(draw(st.integers(1, n - o)) for o, n in zip(lo, info.shape, strict=True)))
            else:
                continue
            wants[rank].append((a, box))
            if draw(st.integers(0, 5)) == 0:  # a second part of the same array (ShardedTensor, LocalShard lists)
                wants[rank].append((a, draw(st.sampled_from([box, *earlier]))))
    return wants, arrays


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    _problems(),
    st.sampled_from([8, 64, 10**9]),
    st.sampled_from([8, 200, 10**9]),
    st.sampled_from([1, 10**9]),
    st.sampled_from([0, 40, 10**9]),
)
def test_every_plan_fills_every_request_exactly_once_and_fetches_no_more_chunks(
    problem: tuple[Wants, list[ArrayInfo]], piece: int, budget: int, pack: int, whole: int
) -> None:
    wants, arrays = problem
    plan = fanout.plan(wants, arrays, piece_bytes=piece, round_bytes=budget, pack_bytes=pack, whole_bytes=whole)
    fetched, _ = _simulate(wants, arrays, plan, whole)
    assert fetched <= _naive_chunks(wants, arrays, whole)
    shared: dict[tuple[int, Box], list[int]] = {}
    for rank, reqs in enumerate(wants):
        for a, box in reqs:
            shared.setdefault((a, box), []).append(rank)
    if all(len(ranks) == 1 for ranks in shared.values()) and not any(
        a == b and x != y and x.intersect(y) for a, x in shared for b, y in shared
    ):
        assert not plan.rounds  # nothing shared: everybody reads its own, no exchange


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_problems(), st.sampled_from([8, 200, 10**9]), st.sampled_from([0, 40, 10**9]), st.sampled_from([8, 64, 10**9]))
def test_joined_objects_fill_every_request_exactly_once_and_fetch_no_more_chunks(
    problem: tuple[Wants, list[ArrayInfo]], budget: int, whole: int, join: int
) -> None:
    wants, arrays = problem
    plan = fanout.plan(wants, arrays, round_bytes=budget, whole_bytes=whole, join_bytes=join)
    fetched, _ = _simulate(wants, arrays, plan, whole)
    assert fetched <= _naive_chunks(wants, arrays, whole)


# an expert shard of 2 experts x 8 rows x 4 columns (8 bytes each), inner chunks of 2 rows: 8 chunks
EXPERT = ArrayInfo((2, 8, 4), (2, 8, 4), (1, 2, 4), 8)


def _rows_of_both_experts(rank: int, world: int) -> Box:
    per = 8 // world
    return Box((0, rank * per, 0), (2, per, 4))


def test_an_object_two_ranks_need_in_pieces_is_read_once_by_one_of_them() -> None:
    """Each of 2 ranks wants half the rows of both experts: chunks {0, 1, 4, 5} and {2, 3, 6, 7}, two
    runs each. One of them reads the object for both and sends the other its half."""
    wants: Wants = [[(0, _rows_of_both_experts(r, 2))] for r in range(2)]
    plan = fanout.plan(wants, [EXPERT], join_bytes=EXPERT.shard_nbytes(0))
    assert plan.solo == ((), ()) and plan.solo_parts == ((), ())
    (rnd,) = plan.rounds
    assert {i.reader for i in rnd.items} == {0} and sorted(i.region.offsets for i in rnd.items) == [
        w[0][1].offsets for w in wants
    ]
    ((src, dsts, nbytes),) = [(m.src, m.dsts, m.nbytes) for m in rnd.messages]
    assert (src, dsts, nbytes) == (0, (1,), 2 * 4 * 4 * 8)
    fetched, _ = _simulate(wants, [EXPERT], plan)
    assert fetched == 8  # every chunk once (each rank alone: 4 + 4 chunks, in 2 runs each)
    for join in (0, EXPERT.shard_nbytes(0) - 1):  # off, or the object larger than one request
        assert not fanout.plan(wants, [EXPERT], join_bytes=join).rounds


def test_parts_in_one_run_are_not_joined() -> None:
    """Rows split in blocks (FSDP's Shard(0) onto more ranks): each part is one run of the object."""
    info = ArrayInfo((8, 4), (8, 4), (2, 4), 8)
    wants: Wants = [[(0, Box((2 * r, 0), (2, 4)))] for r in range(4)]
    assert not fanout.plan(wants, [info], join_bytes=10**9).rounds
    # whole rows of one expert each (experts split over ranks): one run each too
    wants = [[(0, Box((r, 0, 0), (1, 8, 4)))] for r in range(2)]
    assert not fanout.plan(wants, [EXPERT], join_bytes=10**9).rounds


def test_a_box_over_joined_and_other_objects_reads_the_other_parts_itself() -> None:
    """Two expert shards along dimension 0 ([2, 8, 4] each): rank 0 wants rows 0:4 of all four experts,
    rank 1 rows 4:8 of experts 0 and 1 only. Shard 0 is joined; rank 0 reads its part of shard 1 itself."""
    info = ArrayInfo((4, 8, 4), (2, 8, 4), (1, 2, 4), 8)
    wants: Wants = [[(0, Box((0, 0, 0), (4, 4, 4)))], [(0, Box((0, 4, 0), (2, 4, 4)))]]
    plan = fanout.plan(wants, [info], join_bytes=10**9)
    assert plan.solo == ((), ()) and plan.solo_parts == (((0, Box((2, 0, 0), (2, 4, 4))),), ())
    assert sorted((i.region.offsets, i.region.sizes) for rnd in plan.rounds for i in rnd.items) == [
        ((0, 0, 0), (2, 4, 4)),
        ((0, 4, 0), (2, 4, 4)),
    ]
    fetched, _ = _simulate(wants, [info], plan)
    assert fetched == 8 + 4


@settings(max_examples=200, deadline=None)
@given(_problems(), st.integers(2, 6), st.sampled_from([8, 64, 10**9]), st.sampled_from([0, 40, 10**9]))
def test_replicas_on_every_rank_fetch_each_needed_chunk_once(
    problem: tuple[Wants, list[ArrayInfo]], world: int, piece: int, whole: int
) -> None:
    _, arrays = problem
    boxes = [Box.full(a.shape) for a in arrays]
    wants: Wants = [[(a, box) for a, box in enumerate(boxes)] for _ in range(world)]
    plan = fanout.plan(wants, arrays, piece_bytes=piece, whole_bytes=whole)
    fetched, _ = _simulate(wants, arrays, plan, whole)
    assert fetched == sum(len(list(cells_in(box, a.chunk_shape))) for a, box in zip(arrays, boxes, strict=True))


def test_a_replicated_tensor_of_small_shards_is_cut_only_between_shards() -> None:
    info = ArrayInfo((1000, 10), (100, 10), (10, 10), 4)  # 4 KB shards
    wants: Wants = [[(0, Box.full(info.shape))] for _ in range(4)]
    items = [i for rnd in fanout.plan(wants, [info], piece_bytes=10_000, whole_bytes=8000).rounds for i in rnd.items]
    assert len(items) == 4 and all(i.region.offsets[0] % 100 == 0 for i in items)
    _simulate(wants, [info], fanout.plan(wants, [info], piece_bytes=10_000, whole_bytes=8000), 8000)


def test_partial_overlaps_are_read_once_by_one_rank() -> None:
    info = ArrayInfo((16, 4), (16, 4), (4, 4), 4)
    wants: Wants = [[(0, Box((0, 0), (10, 4)))], [(0, Box((5, 0), (10, 4)))], [(0, Box((15, 0), (1, 4)))]]
    plan = fanout.plan(wants, [info], whole_bytes=0)  # chunks read one by one
    assert plan.solo == ((), (), (0,))  # row 15 overlaps nobody's
    (rnd,) = plan.rounds
    assert len({item.reader for item in rnd.items}) == 1
    fetched, _ = _simulate(wants, [info], plan)
    assert fetched == 4 + 1  # rows 0:15 once (4 chunks), the chunk of rows 12:16 again by rank 2 for row 15


def test_a_shard_read_whole_is_read_once_when_replicas_share_it() -> None:
    info = ArrayInfo((90, 4), (90, 4), (15, 4), 4)  # one small shard object, read whole
    halves = [Box((0, 0), (45, 4)), Box((45, 0), (45, 4))]
    wants: Wants = [[(0, halves[0])], [(0, halves[0])], [(0, halves[1])]]  # HSDP-like
    plan = fanout.plan(wants, [info], whole_bytes=10_000)
    assert len({item.reader for rnd in plan.rounds for item in rnd.items}) == 1
    fetched, _ = _simulate(wants, [info], plan, 10_000)
    assert fetched == 6  # the object once, not once per half
    resharded: Wants = [[(0, halves[0])], [(0, halves[1])]]  # no replica: each reads its own, no exchange
    assert fanout.plan(resharded, [info], whole_bytes=10_000).rounds == ()


def test_large_replicas_are_cut_at_chunk_rows_and_spread_over_ranks() -> None:
    info = ArrayInfo((1000, 10), (1000, 10), (30, 10), 4)  # 40 KB
    wants: Wants = [[(0, Box.full(info.shape))] for _ in range(4)]
    plan = fanout.plan(wants, [info], piece_bytes=10_000, whole_bytes=0)
    items = [item for rnd in plan.rounds for item in rnd.items]
    assert len(items) == 4 and {item.reader for item in items} == {0, 1, 2, 3}
    assert all(item.region.offsets[0] % 30 == 0 for item in items)
    assert sum(item.region.sizes[0] for item in items) == 1000
    assert all(len(item.targets) == 3 and item.source == 0 for item in items)


def test_readers_are_spread_by_bytes() -> None:
    arrays = [ArrayInfo((n,), (n,), (n,), 4) for n in (800, 100, 100, 100, 100, 100, 100, 100, 100)]
    wants: Wants = [[(a, Box.full(info.shape)) for a, info in enumerate(arrays)] for _ in range(2)]
    plan = fanout.plan(wants, arrays)
    read = [sum(i.nbytes for rnd in plan.rounds for i in rnd.items if i.reader == r) for r in range(2)]
    assert read == [3200, 3200]


def test_rounds_bound_what_a_rank_receives() -> None:
    arrays = [ArrayInfo((100,), (100,), (10,), 4) for _ in range(10)]  # 400 bytes each
    wants: Wants = [[(a, Box.full((100,))) for a in range(10)] for _ in range(3)]
    plan = fanout.plan(wants, arrays, round_bytes=1000, pack_bytes=1)
    assert len(plan.rounds) > 1
    for rnd in plan.rounds:
        for rank in range(3):
            got = sum(item.nbytes for item in rnd.items if rank in {r for r, _ in item.targets})
            sent = sum(item.nbytes for item in rnd.items if item.reader == rank)
            assert got + sent <= 1000
    _simulate(wants, arrays, plan)


def test_small_items_travel_packed() -> None:
    arrays = [ArrayInfo((4,), (4,), (4,), 4) for _ in range(6)]
    wants: Wants = [[(a, Box.full((4,))) for a in range(6)] for _ in range(3)]
    (rnd,) = fanout.plan(wants, arrays).rounds
    assert len(rnd.messages) == 3  # one message per reader, to the two others
    assert {len(m.items) for m in rnd.messages} == {2}


def test_a_request_for_an_unknown_array_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        fanout.plan([[(1, Box((0,), (1,)))]], [ArrayInfo((4,), (4,), (4,), 4)])


def test_several_parts_of_one_array_on_one_rank() -> None:
    info = ArrayInfo((8,), (8,), (2,), 4)
    strided = [(0, Box((0,), (2,))), (0, Box((4,), (2,)))]  # rows 0:2 and 4:6 on one rank
    wants: Wants = [strided, [(0, Box((4,), (2,))), (0, Box((4,), (2,)))], [(0, Box((6,), (2,)))]]
    plan = fanout.plan(wants, [info], whole_bytes=0)  # chunks read one by one
    assert plan.solo == ((0,), (), (0,))  # rows 0:2 and 6:8 are one rank's only
    (item,) = plan.rounds[0].items  # rows 4:6, wanted three times: read once
    assert {s for s in item.targets} | {(item.reader, item.source)} == {(0, 1), (1, 0), (1, 1)}
    _simulate(wants, [info], plan)


def test_constant_arrays_are_never_exchanged() -> None:
    step, zeros = ArrayInfo((), (), (), 8, constant=True), ArrayInfo((16, 4), (8, 4), (4, 4), 4, constant=True)
    weight = ArrayInfo((16, 4), (8, 4), (4, 4), 4)
    every = [(0, Box.full(())), (1, Box.full((16, 4))), (2, Box.full((16, 4)))]
    wants: Wants = [list(every) for _ in range(3)]
    plan = fanout.plan(wants, [step, zeros, weight], whole_bytes=0)
    assert plan.solo == ((0, 1), (0, 1), (0, 1))  # each rank fills its constants itself
    items = [item for rnd in plan.rounds for item in rnd.items]
    assert items and {item.array for item in items} == {2}  # only the stored array travels
    alone = fanout.plan([[(0, Box.full(()))], [(0, Box.full(()))]], [step])
    assert alone.rounds == () and alone.solo == ((0,), (0,))


# ---------------------------------------------------------------------------------------------
# loads on gloo ranks against moto; bytes counted by the server

ROWS, COLS = 192, 512  # 384 KiB of float32 per tensor
CHUNK_BYTES = 64 * 1024  # 6 inner chunks per tensor


def _replicated() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    model = {f"w{i}": torch.randn(ROWS, COLS, generator=g) for i in range(6)}
    model["emb"] = torch.randn(4 * ROWS, COLS, generator=g).to(torch.bfloat16)  # 768 KiB, bfloat16
    model["big"] = torch.randn(1024, 1024, generator=g).to(torch.bfloat16)  # 2 MiB: one shard over SMALL_OBJECT_BYTES
    model["bias"] = torch.randn(33, generator=g)
    model["step"] = torch.tensor(5, dtype=torch.int64)
    return {"model": model, "rng": torch.Generator().manual_seed(1).get_state(), "blob": b"\x00\x01" * 1000, "epoch": 3}


def _one_copy_bytes(state: dict[str, Any]) -> int:
    model = state["model"]
    return sum(t.numel() * t.element_size() for t in model.values()) + state["rng"].numel() + len(state["blob"])


def _shard_gets(log: RequestLog, url: str) -> tuple[int, int]:
    """(GETs, bytes) of shard objects under ``url``, as the server counted them."""
    gets = [r for r in log.requests(url) if r.method == "GET" and "/c." in r.path]
    return len(gets), sum(r.bytes_sent for r in gets)


def _load_replicated(
    rank: int,
    world: int,
    url: str,
    opts: dict[str, Any],
    fan_out: bool,
    out: str,
    small: bool = False,
    gather_cap: int | None = None,
) -> None:
    if gather_cap is not None:  # more requests in all than this: no fan-out planned, each rank reads its own
        fanread.MAX_GATHERED_REQUESTS = gather_cap
    if small:  # many rounds, pieces and packs
        fanout.ROUND_BYTES, fanout.PIECE_BYTES, fanout.PACK_BYTES = 300_000, 100_000, 200_000
    want = _replicated()
    target = {
        "model": {k: torch.full_like(v, 9) for k, v in want["model"].items()},
        "rng": torch.zeros_like(want["rng"]),
        "blob": b"",
        "epoch": 0,
    }
    target["model"]["w5"] = torch.zeros(COLS, ROWS).t()  # not contiguous: received through a buffer
    target["model"]["bias"] = torch.zeros(33, dtype=torch.float64)  # cast: received into the staging buffer
    zarrckpt.load(target, url, storage_options=opts, fan_out=fan_out, cast=True)
    assert torch.equal(target["model"].pop("bias"), want["model"].pop("bias").double())
    for k, v in want["model"].items():
        got = target["model"][k]
        assert got.dtype == v.dtype and torch.equal(
            got.contiguous().reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)
        ), k
    assert torch.equal(target["rng"], want["rng"])
    assert (target["blob"], target["epoch"]) == (want["blob"], 3)
    Path(out, f"{rank}").write_text("ok")


@pytest.fixture(scope="module")
def replicated_url(s3_server: str) -> Any:
    from zarrckpt.testing import s3_storage_options, unique_url

    url, opts = unique_url("s3"), s3_storage_options(s3_server)
    zarrckpt.save(_replicated(), url, storage_options=opts, chunk_bytes=CHUNK_BYTES)
    yield url, opts
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.rm(root, recursive=True)


@pytest.mark.parametrize(
    ("fan_out", "low", "high", "cap"),
    [(True, 1.0, 1.02, None), (False, 3.98, 4.02, None), (True, 3.98, 4.02, 4)],
    ids=["fan_out", "off", "too_many_requests_to_gather"],
)
def test_4_replicas_fetch_one_copy(
    replicated_url: tuple[str, dict[str, Any]],
    s3_requests: RequestLog,
    tmp_path: Path,
    fan_out: bool,
    low: float,
    high: float,
    cap: int | None,
) -> None:
    url, opts = replicated_url
    spawn(4, _load_replicated, url, opts, fan_out, str(tmp_path), False, cap)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "2", "3"]
    gets, nbytes = _shard_gets(s3_requests, url)
    ratio = nbytes / _one_copy_bytes(_replicated())
    assert low <= ratio <= high, (ratio, gets)


def test_many_rounds_pieces_and_packs_on_3_ranks(
    replicated_url: tuple[str, dict[str, Any]], s3_requests: RequestLog, tmp_path: Path
) -> None:
    url, opts = replicated_url
    meta = zarrckpt.open(url, storage_options=opts)["model.big"].meta
    assert meta.shard_shape == (1024, 1024) and meta.chunk_shape == (32, 1024)
    plan = fanout.plan(  # what the ranks will do with "big" (the same planner, the same sizes)
        [[(0, Box.full((1024, 1024)))]] * 3,
        [ArrayInfo((1024, 1024), (1024, 1024), (32, 1024), 2)],
        round_bytes=300_000,
        piece_bytes=100_000,
        pack_bytes=200_000,
    )
    assert len(plan.rounds) >= 3 and len({i.reader for rnd in plan.rounds for i in rnd.items}) == 3
    spawn(3, _load_replicated, url, opts, True, str(tmp_path), True)
    assert len(list(tmp_path.iterdir())) == 3
    _, nbytes = _shard_gets(s3_requests, url)
    assert nbytes / _one_copy_bytes(_replicated()) <= 1.02


def _mixed_state(rows: int = 90) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "sharded": torch.randn(rows, 256, generator=g),  # resharded 2 -> 3, no replica
        "hsdp": torch.randn(rows, 256, generator=g),  # rows split 2 ways, one half on 2 of the 3 ranks
        "overlap": torch.randn(rows, 256, generator=g),  # ranks hold overlapping row ranges
        "everywhere": torch.randn(rows, 256, generator=g),  # plain tensor on every rank
        "parts": torch.randn(rows, 256, generator=g),  # rank 0 holds two parts (a list of LocalShards)
    }


def _rows(rank: int, world: int, n: int) -> tuple[int, int]:
    return rank * n // world, (rank + 1) * n // world


def _save_mixed(rank: int, world: int, url: str, opts: dict[str, Any]) -> None:
    full = _mixed_state()
    lo, hi = _rows(rank, world, 90)
    state = {k: zarrckpt.LocalShard(v[lo:hi].clone(), tuple(v.shape), (lo, 0)) for k, v in full.items()}
    zarrckpt.save({"m": state}, url, storage_options=opts, chunk_bytes=16 * 1024)


MIXED_BOXES: dict[str, list[Any]] = {  # key -> per rank, the rows it loads (of 90), or a list of parts
    "sharded": [(0, 30), (30, 60), (60, 90)],
    "hsdp": [(0, 45), (0, 45), (45, 90)],
    "overlap": [(0, 50), (20, 70), (40, 90)],
    "everywhere": [(0, 90)] * 3,
    "parts": [[(0, 45), (45, 90)], (45, 90), (0, 45)],
}


def _load_mixed(rank: int, world: int, url: str, opts: dict[str, Any], out: str) -> None:
    full = _mixed_state()
    target: dict[str, Any] = {}
    for key, boxes in MIXED_BOXES.items():
        parts = boxes[rank] if isinstance(boxes[rank], list) else [boxes[rank]]
        shards = [zarrckpt.LocalShard(torch.zeros(hi - lo, 256), (90, 256), (lo, 0)) for lo, hi in parts]
        target[key] = shards if isinstance(boxes[rank], list) else shards[0]
    zarrckpt.load({"m": target}, url, storage_options=opts)
    for key, boxes in MIXED_BOXES.items():
        parts = boxes[rank] if isinstance(boxes[rank], list) else [boxes[rank]]
        shards = target[key] if isinstance(target[key], list) else [target[key]]
        for (lo, hi), shard in zip(parts, shards, strict=True):
            assert torch.equal(shard.data, full[key][lo:hi]), key
    Path(out, f"{rank}").write_text("ok")


def test_mixed_replicated_sharded_and_overlapping_2_to_3(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog, tmp_path: Path
) -> None:
    url, opts = s3_url
    spawn(2, _save_mixed, url, opts)
    s3_requests.clear()
    spawn(3, _load_mixed, url, opts, str(tmp_path))
    assert len(list(tmp_path.iterdir())) == 3
    gets = [r for r in s3_requests.requests(url) if r.method == "GET" and "/c." in r.path]
    per_key = {k: sum(r.bytes_sent for r in gets if f"/m/{k}/c." in r.path) for k in MIXED_BOXES}
    fs, root = fsspec.core.url_to_fs(url, **opts)
    shards = {k: fs.glob(f"{root}/m/{k}/c.*", detail=True) for k in MIXED_BOXES}  # the shard objects
    stored = {k: sum(info["size"] for info in found.values()) for k, found in shards.items()}
    # replicated, partly replicated, overlapping, several parts: every stored byte fetched once
    assert {k: n for k, n in per_key.items() if k != "sharded"} == {k: n for k, n in stored.items() if k != "sharded"}
    # no replicas: read as without fan-out, each rank what it needs (small shards whole, at most 3 times)
    assert stored["sharded"] <= per_key["sharded"] <= 3 * stored["sharded"]


def _load_expecting_failure(rank: int, world: int, url: str, opts: dict[str, Any], out: str, rounds: bool) -> None:
    if rounds:  # w3 is read in a later round, while the transfers of an earlier one are in flight
        fanout.ROUND_BYTES, fanout.PIECE_BYTES = 300_000, 100_000
    want = _replicated()
    target = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}}
    try:
        zarrckpt.load(target, url, storage_options=opts, strict=False)
    except zarrckpt.ZarrckptError as e:
        Path(out, f"{rank}").write_text(json.dumps([type(e).__name__, str(e)]))
    else:
        Path(out, f"{rank}").write_text(json.dumps(["none", ""]))


@pytest.mark.parametrize(("damage", "rounds"), [("corrupt", False), ("missing", False), ("corrupt", True)])
def test_a_failed_read_on_the_reader_raises_on_every_rank(
    s3_url: tuple[str, dict[str, Any]], tmp_path: Path, damage: str, rounds: bool
) -> None:
    url, opts = s3_url
    zarrckpt.save(_replicated(), url, storage_options=opts, chunk_bytes=CHUNK_BYTES)
    fs, root = fsspec.core.url_to_fs(url, **opts)
    shard = f"{root}/model/w3/c.0.0"
    if damage == "corrupt":
        blob = bytearray(fs.cat_file(shard))
        blob[100] ^= 0xFF
        fs.pipe_file(shard, bytes(blob))
    else:
        fs.rm_file(shard)
    spawn(4, _load_expecting_failure, url, opts, str(tmp_path), rounds)
    got = [json.loads(Path(tmp_path, str(r)).read_text()) for r in range(4)]
    kinds = sorted(kind for kind, _ in got)
    # the one rank that read w3 raises the storage error itself; the others a ZarrckptError naming it
    assert kinds == ["CorruptChunkError", "ZarrckptError", "ZarrckptError", "ZarrckptError"], got
    assert all("CorruptChunkError" in msg for kind, msg in got if kind == "ZarrckptError"), got


def _adam_state() -> dict[str, Any]:
    """A model and its Adam state after one step: 0-d ``step`` counters (constant arrays), plus an
    all-zero tensor (constant too) and stored tensors."""
    g = torch.Generator().manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 64, generator=g)).sum().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "zeros": torch.zeros(32, 16), "step": 1}


def _load_constants(rank: int, world: int, url: str, opts: dict[str, Any], out: str) -> None:
    planned: list[FanOutPlan] = []
    real_plan = fanout.plan

    def spy(*args: Any, **kwargs: Any) -> FanOutPlan:  # the real planner, its plan kept for the test
        result = real_plan(*args, **kwargs)
        planned.append(result)
        return result

    fanout.plan = spy
    want = _adam_state()
    target = {
        "model": {k: torch.full_like(v, 9) for k, v in want["model"].items()},
        "optim": {
            "state": {p: {k: torch.full_like(v, 9) for k, v in s.items()} for p, s in want["optim"]["state"].items()},
            "param_groups": want["optim"]["param_groups"],
        },
        "zeros": torch.full((32, 16), 9.0),
        "step": 0,
    }
    zarrckpt.load(target, url, storage_options=opts, fan_out=True)
    for k, v in want["model"].items():
        assert torch.equal(target["model"][k], v), k
    for p, s in want["optim"]["state"].items():
        for k, v in s.items():
            got = target["optim"]["state"][p][k]
            assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), (p, k)
    assert torch.equal(target["zeros"], torch.zeros(32, 16)) and target["step"] == 1
    (plan,) = planned
    exchanged: dict[int, int] = {}
    for rnd in plan.rounds:
        for msg in rnd.messages:
            for i in msg.items:
                exchanged[rnd.items[i].array] = exchanged.get(rnd.items[i].array, 0) + rnd.items[i].nbytes
    Path(out, f"{rank}").write_text(json.dumps({"exchanged": exchanged, "solo": len(plan.solo[rank])}))


def test_fan_out_fills_constant_arrays_locally_on_3_ranks(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog, tmp_path: Path
) -> None:
    url, opts = s3_url
    zarrckpt.save(_adam_state(), url, storage_options=opts, chunk_bytes=8 * 1024)
    ck = zarrckpt.open(url, storage_options=opts)
    keys = ck.keys()  # the fan-out planner numbers the arrays in this order
    constant = {n for n, k in enumerate(keys) if ck[k].meta.constant is not None}
    steps = {n for n, k in enumerate(keys) if k.endswith(".step")}
    assert steps and steps < constant and keys.index("zeros") in constant
    assert len(constant) < len(keys)  # the weights and moments are stored
    s3_requests.clear()
    spawn(3, _load_constants, url, opts, str(tmp_path))
    got = [json.loads(Path(tmp_path, str(r)).read_text()) for r in range(3)]
    for view in got:
        exchanged = {int(a): n for a, n in view["exchanged"].items()}
        assert exchanged, "the stored replicas are fanned out"
        assert not exchanged.keys() & constant, {keys[a]: n for a, n in exchanged.items() if a in constant}
        assert view["solo"] >= len(constant)  # each rank's constants, filled locally
    # no shard object of a constant array was asked for
    assert not [
        r for r in s3_requests.requests(url) if any(f"/{keys[a].replace('.', '/')}/c" in r.path for a in constant)
    ]


# --- a shard object two ranks need in pieces, on gloo ranks against moto ---

EXPERTS_SHAPE = (2, 1024, 256)  # 2 MiB of float32: one shard object of 8 inner chunks (256 rows each)


def _experts() -> torch.Tensor:
    return torch.arange(math.prod(EXPERTS_SHAPE), dtype=torch.float32).reshape(EXPERTS_SHAPE)


def _load_row_halves(rank: int, world: int, url: str, opts: dict[str, Any], fan_out: bool, out: str) -> None:
    rows = EXPERTS_SHAPE[1] // world
    target = zarrckpt.LocalShard(torch.zeros(2, rows, 256), EXPERTS_SHAPE, (0, rank * rows, 0))
    zarrckpt.load({"e": target}, url, storage_options=opts, fan_out=fan_out)
    assert torch.equal(target.data, _experts()[:, rank * rows : (rank + 1) * rows])
    Path(out, f"{rank}").write_text("ok")


@pytest.mark.parametrize("fan_out", [True, False], ids=["fan_out", "off"])
def test_an_object_two_ranks_need_in_pieces_is_fetched_once(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog, tmp_path: Path, fan_out: bool
) -> None:
    """2 ranks each load half the rows of both experts of one shard object (two runs of it each):
    with fan-out one GET of the whole object, read by one rank, which sends the other its half;
    without, each rank reads from its first run to its last, through the other's chunks between."""
    url, opts = s3_url
    zarrckpt.save({"e": _experts()}, url, storage_options=opts, chunk_bytes=256 * 1024)
    meta = zarrckpt.open(url, storage_options=opts)["e"].meta
    assert (meta.shard_shape, meta.chunk_shape) == (EXPERTS_SHAPE, (1, 256, 256))
    s3_requests.clear()
    spawn(2, _load_row_halves, url, opts, fan_out, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1"]
    gets, nbytes = _shard_gets(s3_requests, url)
    chunk, head = 256 * 256 * 4 + 4, 8 * 16 + 4
    assert (gets, nbytes) == ((1, head + 8 * chunk) if fan_out else (2, 2 * 6 * chunk))


SPLIT_SHAPE = (4, 1024, 256)  # 4 MiB of float32, saved by 2 ranks: 2 shard objects of 2 experts each


def _save_split(rank: int, world: int, url: str, opts: dict[str, Any]) -> None:
    full = torch.arange(math.prod(SPLIT_SHAPE), dtype=torch.float32).reshape(SPLIT_SHAPE)
    shard = zarrckpt.LocalShard(full[2 * rank : 2 * rank + 2].clone(), SPLIT_SHAPE, (2 * rank, 0, 0))
    zarrckpt.save({"e": shard}, url, storage_options=opts, chunk_bytes=256 * 1024)


def _load_split(rank: int, world: int, url: str, opts: dict[str, Any], out: str) -> None:
    full = torch.arange(math.prod(SPLIT_SHAPE), dtype=torch.float32).reshape(SPLIT_SHAPE)
    # rank 0: rows 0:512 of all 4 experts (both objects); rank 1: rows 512:1024 of experts 0 and 1
    experts, rows = (slice(0, 4), slice(0, 512)) if rank == 0 else (slice(0, 2), slice(512, 1024))
    want = full[experts, rows]
    target = zarrckpt.LocalShard(torch.zeros_like(want), SPLIT_SHAPE, (0, rows.start, 0))
    zarrckpt.load({"e": target}, url, storage_options=opts)
    assert torch.equal(target.data, want)
    Path(out, f"{rank}").write_text("ok")


def test_a_box_split_between_a_joined_object_and_its_own(
    s3_url: tuple[str, dict[str, Any]], s3_requests: RequestLog, tmp_path: Path
) -> None:
    """Object 0 (experts 0-1) is needed in pieces by both ranks: read once, whole. Object 1 (experts
    2-3) only by rank 0, which reads its part itself (a solo part of its box): rows 0:512 of both
    experts, one GET through the gap between them."""
    url, opts = s3_url
    spawn(2, _save_split, url, opts)
    assert zarrckpt.open(url, storage_options=opts)["e"].meta.shard_shape == (2, 1024, 256)
    s3_requests.clear()
    spawn(2, _load_split, url, opts, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1"]
    chunk, head = 256 * 256 * 4 + 4, 8 * 16 + 4
    gets = sorted(
        (r.path.rsplit("/", 1)[-1].split(".")[1], r.bytes_sent)  # .../e/c.R.0.0: rank R's shard
        for r in s3_requests.requests(url)
        if r.method == "GET" and "/c." in r.path
    )
    assert gets == [("0", head + 8 * chunk), ("1", 6 * chunk)]
