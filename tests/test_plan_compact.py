"""Planning from layouts (zarrckpt.engine.saveplan.plan_compact, over zarrckpt.plan.compact) against
the planner that gathers every description.

On real gloo ranks: the same state saved both ways must give the same objects, byte for byte
(the manifest's save id and time aside), and every rank's plan must be the one
``build_save_plan`` builds from all ranks' descriptions.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from states import mixed_state
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import zarrckpt
from zarrckpt.api import _save as save_with
from zarrckpt.engine.dist import Group
from zarrckpt.engine.saveplan import plan_compact
from zarrckpt.plan import blocks
from zarrckpt.plan.localstate import collect
from zarrckpt.plan.rankdesc import RankDescription
from zarrckpt.plan.save import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES, build_save_plan
from zarrckpt.testing import spawn


def _dt(full: torch.Tensor, mesh: Any, placements: list[Any]) -> DTensor:
    sizes, offsets = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    local = full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))].clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def staged_state(rank: int, world: int) -> dict[str, Any]:
    """A pipeline of 2 stages x 2 DP ranks: stage DTensors on the stage's DP mesh, one over the whole
    mesh, replicated step counters, zero moments, a small norm (joined), per-rank RNG bytes and
    per-DP-rank values."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    stage, dp = divmod(rank, world // 2)
    g = torch.Generator().manual_seed(11)
    state: dict[str, Any] = {"model": {}, "optim": {}}
    for s in range(2):
        w, norm = torch.randn(8, 6, generator=g), torch.randn(6, generator=g)
        if s != stage:
            continue
        state["model"][f"layers.{s}.w"] = _dt(w, mesh["dp"], [Shard(0)])
        state["model"][f"layers.{s}.norm"] = _dt(norm, mesh["dp"], [Shard(0)])
        state["model"][f"layers.{s}.bias"] = _dt(torch.arange(5.0) + s, mesh["dp"], [Replicate()])
        state["optim"][f"layers.{s}.w.exp_avg"] = _dt(torch.zeros(8, 6), mesh["dp"], [Shard(0)])
        state["optim"][f"layers.{s}.w.step"] = torch.tensor(float(100 + s))
    state["model"]["embed"] = _dt(torch.randn(10, 6, generator=g), mesh, [Shard(0), Shard(1)])
    state["model"]["b"] = torch.arange(15, dtype=torch.float16).reshape(3, 5)
    state["step"] = 1000
    state["config"] = {"name": "staged", "lr": 3e-4}
    state["dataloader"] = {f"dp_{dp}": {"index": 17 * dp}}
    state["rng"] = {f"rank_{rank}": torch.Generator().manual_seed(rank).get_state().numpy().tobytes()}
    return state


STATES = {"staged": staged_state, "mixed": lambda rank, world: mixed_state(rank, world, fill=True, save_world=world)}


def _compare_plans(rank: int, world: int, which: str, expect_compact: bool) -> None:
    local = collect(STATES[which](rank, world))
    group = Group()
    views = group.all_gather_json(local.describe().to_json())
    want = build_save_plan(
        [RankDescription.from_json(v) for v in views], DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES
    )
    got = plan_compact(group, local, DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES)
    assert (got is not None) == expect_compact
    if got is None:
        return
    plan = got.plan
    assert plan.shards_of(rank) == want.shards_of(rank)
    assert plan.metadata_of(rank) == want.metadata_of(rank)
    n, starts = blocks.block_starts(_held_by_rank(views), want)
    assert got.blocks == n > 0 and want.chosen_writers()
    if rank == 0:  # the coordinator: the whole plan
        assert plan == want and got.block_index == blocks.block_index(_held_by_rank(views), want, starts)
        return
    held = set(local.tensors)  # the tensors its class holds, with their writers from the whole save
    assert len(plan.arrays) < len(want.arrays)
    assert {k: want.gathers[k] for k in want.gathers if k in held} == plan.gathers
    assert want.replicated & held == plan.replicated
    assert {k: want.owners[k] for k in plan.owners} == plan.owners
    index = blocks.block_index(_held_by_rank(views), want, starts)
    assert got.block_index == {k: i for k, i in index.items() if k[0] in held}


def _held_by_rank(views: list[Any]) -> dict[str, tuple[list[int], list[Any]]]:
    """Every replicated tensor's holders and specs, from every rank's description."""
    out: dict[str, tuple[list[int], list[Any]]] = {}
    for rank, view in enumerate(views):
        desc = RankDescription.from_json(view)
        for key, parts in desc.tensors.items():
            for i in parts:
                entry = out.setdefault(key, ([], []))
                entry[0].append(rank)
                entry[1].append(desc.specs[i])
    return out


def _save(rank: int, world: int, which: str, url: str, force: bool) -> None:
    """``zarrckpt.save``, planned by gathering every description where ``force``."""
    options = inspect.signature(zarrckpt.save).parameters
    defaults = {k: p.default for k, p in options.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    save_with(STATES[which](rank, world), url, **defaults, force_gather=force)


def _files(root: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.relative_to(root).as_posix() == "zarr.json":
                doc = json.loads(data)
                attrs = doc["attributes"]["zarrckpt"]
                for per_save in ("save_id", "created", "attributes_crc32c"):  # the last covers the first two
                    assert per_save in attrs
                    attrs[per_save] = None
                data = json.dumps(doc).encode()
            out[p.relative_to(root).as_posix()] = data
    return out


@pytest.mark.parametrize(("which", "expect_compact"), [("staged", True), ("mixed", False)])
def test_plans_match_the_gathering_planner(which: str, expect_compact: bool) -> None:
    spawn(4, _compare_plans, which, expect_compact)


@pytest.mark.parametrize("which", ["staged", "mixed"])
def test_checkpoints_are_byte_identical(tmp_path: Path, which: str) -> None:
    spawn(4, _save, which, str(tmp_path / "gathered"), True)
    spawn(4, _save, which, str(tmp_path / "compact"), False)
    before, after = _files(tmp_path / "gathered"), _files(tmp_path / "compact")
    assert before.keys() == after.keys() and len(before) > 10
    assert [k for k in before if before[k] != after[k]] == []


def _differing_replicas(rank: int, world: int, url: str) -> None:
    """Stage 0 (ranks 0, 1) holds a replicated tensor whose copies differ; stage 1 holds no replicated
    tensor at all, so its ranks' own plans list no replicated block: they must still take part in the
    check and fail with the others, not hang or write."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    stage = rank // (world // 2)
    state: dict[str, Any] = {f"stage{stage}": {"w": _dt(torch.arange(8.0).reshape(4, 2), mesh["dp"], [Shard(0)])}}
    if stage == 0:
        state["stage0"]["rep"] = torch.arange(3.0) + rank  # a plain tensor: replicated, differing
    with pytest.raises(zarrckpt.SaveLayoutError, match=r"stage0\.rep: replicas with different contents"):
        zarrckpt.save(state, url)


def test_differing_replicas_fail_every_rank_also_those_holding_none(tmp_path: Path) -> None:
    spawn(4, _differing_replicas, str(tmp_path / "ck"))
    assert not (tmp_path / "ck" / "zarr.json").exists()


@pytest.mark.parametrize(
    ("shape", "dtype"), [((5056,), "uint8"), ((3, 1 << 20), "float32"), ((7, 5, 3), "bfloat16"), ((1,), "int64")]
)
def test_a_tensor_one_rank_holds_whole_gets_the_general_grid(shape: tuple[int, ...], dtype: str) -> None:
    """The shortcut for a per-rank tensor (one holder, the whole tensor) against the general path."""
    from zarrckpt.format.dtypes import storage_dtype
    from zarrckpt.format.layout import Box, Claim, inner_chunk_shape, owner_of_cells, shard_shape_for
    from zarrckpt.plan.grids import _grid
    from zarrckpt.plan.rankdesc import TensorSpec
    from zarrckpt.types import ArrayKind

    spec = TensorSpec(shape, dtype, ArrayKind.TENSOR, Box.full(shape), {"mesh": None, "placements": "x"})
    got = _grid([5], [spec], 8, 1 << 20)
    shard = shard_shape_for(shape, [spec.box])
    assert got.shard == shard and got.shape == shape and not got.replicated and not got.holders
    assert got.chunk == inner_chunk_shape(shard, storage_dtype(dtype).itemsize, 1 << 20)
    assert got.owners == owner_of_cells(shape, shard, [Claim(5, spec.box)])
    assert got.topology == {"placements": "x", "world_size": 8, "holders": 1}
