"""Multi-process (gloo) round trips: save with one topology, load with another, bit-exact."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from states import check_loaded, global_tensor, mixed_state, shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import zarrckpt
from zarrckpt.testing import spawn


def _save_mixed(rank: int, world: int, url: str, opts: dict | None) -> None:
    zarrckpt.save(mixed_state(rank, world, fill=True, save_world=world), url, storage_options=opts)


def _load_mixed(rank: int, world: int, url: str, opts: dict | None, save_world: int) -> None:
    state = mixed_state(rank, world, fill=False, save_world=save_world)
    zarrckpt.load(state, url, storage_options=opts)
    check_loaded(state, rank, world, save_world)


@pytest.fixture(scope="module")
def saved_by_4(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = str(tmp_path_factory.mktemp("ckpt") / "world4")
    spawn(4, _save_mixed, url, None)
    return url


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_save_4_load_any(saved_by_4: str, world: int) -> None:
    spawn(world, _load_mixed, saved_by_4, None, 4)


@pytest.mark.slow
def test_replicated_and_stage_tensors_have_one_writer(saved_by_4: str) -> None:
    """Each shard object exists once; a replicated tensor is one shard, not one per rank; a small
    tensor sharded over the ranks is one shard too (written by one rank, sent the others' rows)."""
    root = Path(saved_by_4)
    assert [p.name for p in (root / "model/layers/0/mlp/b1").glob("c*")] == ["c.0.0"]
    meta = json.loads((root / "model/embed/weight/zarr.json").read_text())
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [10, 6]  # 10 rows over 4 ranks, 240 bytes
    assert [p.relative_to(root).as_posix() for p in (root / "model/embed/weight").glob("c*")] == [
        "model/embed/weight/c.0.0"
    ]
    assert meta["attributes"]["zarrckpt"]["topology"]["holders"] == 4
    stage = json.loads((root / "model/stage1/w/zarr.json").read_text())["attributes"]["zarrckpt"]
    assert stage["topology"]["holders"] == 2 and stage["topology"]["world_size"] == 4
    assert not (root / ".zarrckpt-pending.json").exists()


def _save_2d(rank: int, world: int, url: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    w = shard("model.layers.0.attn.wqkv", mesh, [Shard(0), Shard(1)], True)
    zarrckpt.save({"w": w}, url, small_tensor_bytes=0)  # one shard per rank's box, however small


def _load_2d_into_3(rank: int, world: int, url: str) -> None:
    mesh = init_device_mesh("cpu", (3,))
    target = {"w": shard("model.layers.0.attn.wqkv", mesh, [Shard(1)], False)}
    zarrckpt.load(target, url)
    assert torch.equal(target["w"].full_tensor(), global_tensor("model.layers.0.attn.wqkv"))


@pytest.mark.slow
def test_2x2_mesh_to_world_3(tmp_path: Path) -> None:
    url = str(tmp_path / "mesh2d")
    spawn(4, _save_2d, url)
    meta = json.loads((tmp_path / "mesh2d/w/zarr.json").read_text())
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [4, 6]
    assert meta["attributes"]["zarrckpt"]["topology"]["placements"] == ["Shard(dim=0)", "Shard(dim=1)"]
    spawn(3, _load_2d_into_3, url)


def _misdeclared(rank: int, world: int, url: str) -> None:
    # both ranks claim experts [0:2] of a [4, 3] expert tensor: experts 2..4 are held by nobody
    both_low = {"experts": zarrckpt.LocalShard(torch.ones(2, 3), (4, 3), (0, 0))}
    with pytest.raises(zarrckpt.SaveLayoutError) as err:
        zarrckpt.save(both_low, url)
    assert "experts: region [2:4, 0:3] is held by no rank" in str(err.value)
    # rank 0 claims [0:3], rank 1 claims [2:4]: row 2 is claimed twice
    overlap = {"experts": zarrckpt.LocalShard(torch.ones(3 - rank, 3), (4, 3), (2 * rank, 0))}
    with pytest.raises(zarrckpt.SaveLayoutError) as err:
        zarrckpt.save(overlap, url)
    assert "experts: region [2:3, 0:3] is claimed twice" in str(err.value)
    dist.barrier()
    assert not os.path.exists(url), "nothing may be written when the layout is invalid"


@pytest.mark.slow
def test_uncovered_and_double_claims_fail_on_every_rank(tmp_path: Path) -> None:
    spawn(2, _misdeclared, str(tmp_path / "bad"))


def _disagree(rank: int, world: int, url: str) -> None:
    state = {"w": torch.zeros(3 + rank)} if rank < 2 else {"w": torch.zeros(3)}
    with pytest.raises(zarrckpt.SaveLayoutError, match="ranks disagree on shape"):
        zarrckpt.save(state, url)
    with pytest.raises(zarrckpt.SaveLayoutError, match="different contents"):
        zarrckpt.save({"rng": torch.full((4,), rank)}, url)
    with pytest.raises(zarrckpt.SaveLayoutError, match="hold different values"):
        zarrckpt.save({"step": rank}, url)


@pytest.mark.slow
def test_ranks_that_disagree_are_refused(tmp_path: Path) -> None:
    spawn(3, _disagree, str(tmp_path / "bad"))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_object_store_round_trip_4_to_3(backend: str, request: pytest.FixtureRequest) -> None:
    url, opts = request.getfixturevalue(f"{backend}_url")
    spawn(4, _save_mixed, url, opts)
    spawn(3, _load_mixed, url, opts, 4)


def _load_expecting(rank: int, world: int, url: str, kind: str, match: str) -> None:
    error = getattr(zarrckpt, kind)
    try:
        zarrckpt.load({"w": torch.zeros(4)}, url)
    except error as e:  # the same type on every rank, though only rank 0 read the manifest
        assert match in str(e), (rank, str(e))
    else:
        raise AssertionError(f"rank {rank}: no {kind}")


@pytest.mark.slow
def test_a_missing_or_uncommitted_checkpoint_raises_the_same_error_on_every_rank(tmp_path: Path) -> None:
    spawn(3, _load_expecting, str(tmp_path / "nothing"), "CheckpointNotFoundError", "nothing is stored there")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / ".zarrckpt-pending.json").write_text("{}")
    spawn(3, _load_expecting, str(tmp_path / "half"), "IncompleteCheckpointError", "never committed")


def _gather_alike(rank: int, world: int) -> None:
    from zarrckpt.engine.dist import Group

    group = Group()
    mine = {"keys": ["a", "b"] if rank % 2 == 0 else ["c"], "mismatches": []}
    expected = group.all_gather_json(mine)
    got = group.all_gather_alike_json(mine)
    assert got == expected and got[0] is got[2]  # one decoded copy per distinct object
    assert group.all_gather_alike_json(mine, max_distinct=1) == expected  # too many distinct: gathered whole
    own = {"rank": rank}  # every rank distinct, under the limit: one broadcast each
    assert group.all_gather_alike_json(own) == [{"rank": r} for r in range(world)]


@pytest.mark.slow
def test_gathering_alike_objects_sends_each_once_and_matches_a_plain_gather() -> None:
    spawn(4, _gather_alike)


def _asks_differ(rank: int, world: int, url: str) -> None:
    saved = {"a": torch.ones(2), "b": torch.ones(3), "c": {"x": torch.ones(4), "y": torch.ones(5)}, "d": 7}
    alone = dist.new_group([0])  # every rank creates it
    if rank == 0:
        zarrckpt.save(saved, url, process_group=alone)
    dist.barrier()
    asks = [{"a": torch.zeros(2), "c": {"x": torch.zeros(4)}}, {"b": torch.zeros(3), "c": {"y": torch.zeros(5)}}]
    asks.append({"a": torch.zeros(2), "d": 0})
    zarrckpt.load(asks[rank], url)  # strict: together the ranks ask for every saved key
    mine = asks[rank]
    got = [mine.get("a"), mine.get("b"), *mine.get("c", {}).values()]
    assert all(bool((t == 1).all()) for t in got if t is not None) and mine.get("d", 7) == 7
    fewer = [{"a": torch.zeros(2)}, {"b": torch.zeros(3), "c": {"y": torch.zeros(5)}}, {"d": 0}]
    with pytest.raises(zarrckpt.LayoutMismatchError, match=r"c\.x: in the checkpoint, not expected") as err:
        zarrckpt.load(fewer[rank], url)  # no rank asks for c.x: every rank is refused
    assert err.value.differences == ["c.x: in the checkpoint, not expected"]
    more = [{"a": torch.zeros(2)}, {"e": torch.zeros(1)}, {"a": torch.zeros(2)}][rank]
    with pytest.raises(zarrckpt.LayoutMismatchError, match="e: expected, not in the checkpoint"):
        zarrckpt.load(more, url, keys=["a", "e"])  # rank 1's missing key fails every rank
    zarrckpt.load(more | ({"a": torch.zeros(2)} if rank == 1 else {}), url, keys=["a", "e"], strict=False)


@pytest.mark.slow
def test_the_ranks_asks_are_decided_together(tmp_path: Path) -> None:
    """The saved keys some rank asks for travel as flags, the rest as distinct lists: a key only one
    rank asks for counts, one no rank asks for is refused on every rank, as is one rank's missing key."""
    spawn(3, _asks_differ, str(tmp_path / "ck"))


class _Counting:
    """``torch.distributed`` as :mod:`zarrckpt.engine.dist` sees it, noting each collective it makes."""

    def __init__(self, real: object) -> None:
        self.real, self.calls = real, []

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.real, name)
        if name not in {"all_gather", "broadcast", "gather", "all_reduce", "barrier", "scatter"}:
            return attr

        def counted(*args: object, **kwargs: object) -> object:
            self.calls.append(name)
            return attr(*args, **kwargs)

        return counted


def _primitives(rank: int, world: int) -> None:
    from zarrckpt.engine import dist as zdist

    group, counting = zdist.Group(), _Counting(zdist.torch_dist)
    cap = group.inline_bytes() - 8  # an object's bytes that travel with its length
    zdist.torch_dist = counting  # (this process only)
    real_max = zdist.GATHER_MAX
    try:
        # gloo: a small gather goes to rank 0 and back in a tree; above GATHER_MAX in all, gloo's ring
        for most in (real_max, (cap + 8) * world):  # the second: only a gather's first collective fits

            def calls(total: int, most: int = most) -> list[str]:  # what an all-gather of `total` bytes makes
                return ["gather", "broadcast"] if total <= most else ["all_gather"]

            zdist.GATHER_MAX = most
            for size in (0, cap - 3, cap - 2, cap - 1, cap + 5, 3 * zdist.INLINE_MAX):  # a string: 2 quotes more
                for alone in (False, True):  # every rank's object that long, or only rank 1's
                    obj = "x" * size if not alone or rank == 1 else "y" * rank
                    counting.calls.clear()
                    got = group.all_gather_json(obj)
                    expected: list[object] = [None] * world
                    dist.all_gather_object(expected, obj)  # torch's own gather: the oracle
                    assert got == expected, (size, alone)
                    longest = max(len(json.dumps(o)) for o in expected)
                    rest = [] if longest <= cap else calls((longest - cap) * world)
                    assert counting.calls == calls((cap + 8) * world) + rest, (size, alone, most)
            for n in (16, cap + 9):
                counting.calls.clear()
                fixed = group.all_gather_fixed(bytes([rank]) * n)
                assert fixed == [bytes([r]) * n for r in range(world)] and counting.calls == calls(n * world)
            for n in (1, 54, cap):  # int64s: a load's "asked for by nobody" flags
                values = np.random.default_rng(rank * 1000 + n).integers(-(2**62), 2**62, n)
                counting.calls.clear()
                low = group.all_reduce_min(values)
                oracle = torch.from_numpy(values.copy())
                dist.all_reduce(oracle, op=dist.ReduceOp.MIN)  # torch's own all-reduce
                assert np.array_equal(low, oracle.numpy()), n
                assert counting.calls == (calls(8 * n * world) if 8 * n * world <= most else ["all_reduce"]), n
        zdist.GATHER_MAX = real_max
        for root in range(world):
            for size in (0, zdist.INLINE_MAX - 10, zdist.INLINE_MAX - 9, zdist.INLINE_MAX - 8, 5 * zdist.INLINE_MAX):
                data = bytes([65 + root]) * size if rank == root else b"not sent"
                counting.calls.clear()
                assert group.broadcast_from(root, data) == bytes([65 + root]) * size, (root, size)
                assert counting.calls == ["broadcast"] * (1 if size <= zdist.INLINE_MAX - 9 else 2), (root, size)
        counting.calls.clear()
        assert group.on_rank0(lambda: b"r" * 100, "reading") == b"r" * 100
        assert counting.calls == ["broadcast"]  # its outcome and its result together
        assert group.on_rank0(lambda: b"m" * 5000, "reading") == b"m" * 5000  # (a manifest: the rest follows)
        assert counting.calls == ["broadcast"] * 3

        def refused() -> bytes:
            raise zarrckpt.IncompleteCheckpointError("never committed")

        with pytest.raises(zarrckpt.IncompleteCheckpointError, match="never committed"):
            group.on_rank0(refused, "opening")  # the same type on every rank

        def broken() -> bytes:
            raise ValueError("bad value")

        with pytest.raises(ValueError if rank == 0 else zarrckpt.ZarrckptError, match="bad value") as err:
            group.on_rank0(broken, "opening")
        assert rank == 0 or "opening failed on rank 0: ValueError" in str(err.value)
    finally:
        zdist.torch_dist = counting.real
        zdist.GATHER_MAX = real_max


@pytest.mark.slow
def test_small_objects_travel_in_one_collective_and_every_size_arrives_whole() -> None:
    spawn(3, _primitives)


@pytest.mark.parametrize(("world", "inline"), [(2, 1024), (64, 1024), (128, 512), (1024, 64), (4096, 16), (16384, 16)])
def test_a_gathers_first_collective_stays_small_at_any_scale(world: int, inline: int) -> None:
    from zarrckpt.engine.dist import Group

    group = Group()
    group.size = world  # (the rule alone: no process group)
    assert group.inline_bytes() == inline
    assert len(json.dumps(None)) + 2 <= inline - 8  # a run_together's "[null]" still fits at the floor


def test_gathered_buffers_come_to_the_host_alike_from_a_gpu() -> None:
    from types import SimpleNamespace

    from zarrckpt.engine.dist import Group

    bufs = [torch.tensor([r, r + 1, 255], dtype=torch.uint8) for r in range(3)]
    on_cpu = Group()._on_host(bufs)
    gpu = Group()
    gpu.device = SimpleNamespace(type="cuda")  # type: ignore[assignment]  # (the branch alone: one stacked copy)
    assert (
        [a.tolist() for a in gpu._on_host(bufs)] == [a.tolist() for a in on_cpu] == [[r, r + 1, 255] for r in range(3)]
    )
