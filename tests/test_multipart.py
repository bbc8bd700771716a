"""Several parts of one global tensor on one rank: lists of LocalShards, ShardedTensors with several
local shards, and DCP write items with several chunks. Each part's region becomes shard objects of
its own; loads fill every part of a target in place; DCP's own storage is the oracle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import zarrckpt
from zarrckpt.errors import SaveLayoutError
from zarrckpt.format.layout import Box
from zarrckpt.plan.rankdesc import RankDescription, TensorSpec
from zarrckpt.testing import spawn
from zarrckpt.types import ArrayKind

FULL = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)


def _blocks(rows: list[tuple[int, int]], fill: bool = True) -> list[zarrckpt.LocalShard]:
    return [zarrckpt.LocalShard(FULL[a:b].clone() if fill else torch.zeros(b - a, 3), (8, 3), (a, 0)) for a, b in rows]


def _shard_files(root: Path, path: str) -> list[str]:
    return sorted(p.name for p in (root / path).glob("c.*"))


def test_a_list_of_local_shards_round_trips_into_any_blocking(tmp_path: Path) -> None:
    url = tmp_path / "ckpt"
    zarrckpt.save({"w": _blocks([(6, 8), (0, 2), (2, 4), (4, 6)])}, url, small_tensor_bytes=0)  # any order
    assert _shard_files(url, "w") == ["c.0.0", "c.1.0", "c.2.0", "c.3.0"]  # each part its own shard objects
    whole = {"w": torch.zeros(8, 3)}
    zarrckpt.load(whole, url)
    assert torch.equal(whole["w"], FULL)
    parts = _blocks([(1, 4), (5, 8)], fill=False)  # not all of it, not on the saved grid
    zarrckpt.load({"w": parts}, url)
    assert torch.equal(parts[0].data, FULL[1:4]) and torch.equal(parts[1].data, FULL[5:8])
    assert not zarrckpt.open(url).verify()["problems"]


def test_parts_that_overlap_or_leave_a_gap_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SaveLayoutError, match=r"w: region \[2:3, 0:3\] is claimed twice"):
        zarrckpt.save({"w": _blocks([(0, 3), (2, 8)])}, tmp_path / "overlap")
    with pytest.raises(SaveLayoutError, match=r"w: region \[4:6, 0:3\] is held by no rank"):
        zarrckpt.save({"w": _blocks([(0, 4), (6, 8)])}, tmp_path / "gap")
    with pytest.raises(zarrckpt.UnsupportedValueError, match="different global shapes"):
        zarrckpt.save({"w": [*_blocks([(0, 4)]), zarrckpt.LocalShard(torch.zeros(4, 3), (9, 3), (4, 0))]}, tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("staging", ["caller", "background"])
def test_async_save_writes_every_part(tmp_path: Path, staging: str) -> None:
    url = tmp_path / "ckpt"
    zarrckpt.async_save({"w": _blocks([(0, 2), (2, 8)]), "b": torch.ones(3)}, url, staging=staging).result()
    got = {"w": torch.zeros(8, 3), "b": torch.zeros(3)}
    zarrckpt.load(got, url)
    assert torch.equal(got["w"], FULL) and torch.equal(got["b"], torch.ones(3))


def test_descriptions_of_several_parts_survive_the_wire() -> None:
    spec = TensorSpec((8, 3), "float32", ArrayKind.TENSOR, Box((0, 0), (2, 3)), {})
    other = TensorSpec((8, 3), "float32", ArrayKind.TENSOR, Box((4, 0), (2, 3)), {})
    desc = RankDescription.of([("w", spec), ("w", other), ("m", spec)], {"step": 3})
    assert desc.tensors == {"w": (0, 1), "m": (0,)} and len(desc.specs) == 2
    assert RankDescription.from_json(json.loads(json.dumps(desc.to_json()))) == desc
    for bad in ({"specs": [], "tensors": {"w": 0}, "values": {}}, {"specs": [{"shape": [8]}], "tensors": {}}, []):
        with pytest.raises(SaveLayoutError, match=r"malformed|refer to no spec"):
            RankDescription.from_json(bad)


# -- several ranks: ShardedTensor with two local shards each, zarrckpt.save and DCP --------------------------


def _sharded(rank: int, rows: list[tuple[int, int]], fill: bool) -> Any:
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    from torch.distributed._shard.sharding_spec import ShardMetadata

    data = [FULL[a:b].clone() if fill else torch.zeros(b - a, 3) for a, b in rows]
    local = [
        Shard(d, ShardMetadata([a, 0], [b - a, 3], f"rank:{rank}/cpu")) for d, (a, b) in zip(data, rows, strict=True)
    ]
    return init_from_local_shards(local, [8, 3])


SAVED = {0: [(0, 2), (4, 6)], 1: [(2, 4), (6, 8)]}  # 4 row blocks of 8x3, interleaved over 2 ranks
LOADED = {0: [(0, 3)], 1: [(3, 5), (5, 8)]}  # another blocking


def _ranks(rank: int, world: int, root: str) -> None:
    state = {"st": _sharded(rank, SAVED[rank], True), "rep": _blocks([(0, 4), (4, 8)])}
    zarrckpt.save(state, f"{root}/native", small_tensor_bytes=0)
    for kind, writer in (("fs", dcp.FileSystemWriter), ("zarr", zarrckpt.ZarrWriter)):
        dcp.save({"st": _sharded(rank, SAVED[rank], True)}, storage_writer=writer(f"{root}/{kind}"))
    got = {}
    for kind, reader in (("fs", dcp.FileSystemReader), ("zarr", zarrckpt.ZarrReader)):
        target = {"st": _sharded(rank, LOADED[rank], False)}
        dcp.load(target, storage_reader=reader(f"{root}/{kind}"))
        got[kind] = [s.tensor for s in target["st"].local_shards()]
    assert all(torch.equal(a, b) for a, b in zip(got["fs"], got["zarr"], strict=True)), f"rank {rank}"
    native = {"st": _sharded(rank, LOADED[rank], False), "rep": torch.zeros(8, 3)}
    zarrckpt.load(native, f"{root}/native")
    for (a, b), shard in zip(LOADED[rank], native["st"].local_shards(), strict=True):
        assert torch.equal(shard.tensor, FULL[a:b]), (rank, a, b)
    assert torch.equal(native["rep"], FULL)
    mixed = _blocks([(0, 4), (4, 8)])
    mixed[1].data[0, 0] += rank  # rank 1's replica of the second block differs
    with pytest.raises(SaveLayoutError, match=r"rep \(block at \[4, 0\]\): replicas with different contents"):
        zarrckpt.save({"rep": mixed}, f"{root}/mixed")
    dist.barrier()


@pytest.mark.slow
def test_sharded_tensors_with_several_shards_per_rank(tmp_path: Path) -> None:
    """zarrckpt.save and dcp.save + ZarrWriter of a ShardedTensor with two local shards per rank;
    loaded into another blocking, equal to what DCP's FileSystemReader gives; a list of LocalShards
    replicated on both ranks is written once and its replicas are compared part by part."""
    spawn(2, _ranks, str(tmp_path))
    assert _shard_files(tmp_path / "native", "st") == ["c.0.0", "c.1.0", "c.2.0", "c.3.0"]
    assert _shard_files(tmp_path / "zarr", "st") == ["c.0.0", "c.1.0", "c.2.0", "c.3.0"]
    assert _shard_files(tmp_path / "native", "rep") == ["c.0.0", "c.1.0"]
    assert not (tmp_path / "mixed" / "zarr.json").exists()
    assert all(not zarrckpt.open(tmp_path / k).verify()["problems"] for k in ("zarr", "native"))
