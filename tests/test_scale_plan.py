"""The scale model (benchmarks/scale_model.py), reduced to 64 ranks, through the real planning path.

Behaviour, not timing: every rank's description comes from ``collect(state).describe()`` of meta
DTensors under a fake process group, and the plan built from them must have exactly the shards
the layout implies, tile every tensor exactly once, and agree with the plan built from
descriptions without shared specs. A resharding load plan must cover every target region.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from zarrckpt.errors import SaveLayoutError
from zarrckpt.format.layout import Box, cell_box
from zarrckpt.format.manifest import Manifest, group_paths
from zarrckpt.plan.fetch import plan_reads
from zarrckpt.plan.rankdesc import RankDescription
from zarrckpt.plan.save import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES, ZarrSavePlan, build_save_plan


def _load_scale_model() -> Any:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "scale_model.py"
    spec = importlib.util.spec_from_file_location("scale_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["scale_model"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


sm = _load_scale_model()
ss = sys.modules["scale_state"]  # the model and its ranks' state, imported by scale_model
DIMS = sm.Dims(layers=4, d_model=256, heads=4, kv_heads=2, head_dim=64, experts=32, top_k=4, d_ff=96, vocab=1024)
SAVE = sm.Layout(pp=2, dp=32, ep_mp=16, ep_dp=2)  # 64 ranks
LOAD = sm.Layout(pp=1, dp=48, ep_mp=16, ep_dp=3)  # 48 ranks, uneven splits of d_model


@pytest.fixture(scope="module")
def raws() -> list[bytes]:
    return sm.gather_descriptions(DIMS, SAVE)


@pytest.fixture(scope="module")
def plan(raws: list[bytes]) -> ZarrSavePlan:
    return build_save_plan(sm.decode(raws))  # every box its shards, however small (small_tensor_bytes=0)


def test_descriptions_share_specs(raws: list[bytes]) -> None:
    desc = json.loads(raws[0])
    assert len(desc["specs"]) < len(desc["tensors"])
    spec = desc["tensors"]["model.layers.0.attn.wqkv"]
    assert desc["tensors"]["optim.state.model.layers.0.attn.wqkv.exp_avg"] == spec
    assert desc["tensors"]["optim.state.model.layers.0.attn.wqkv.exp_avg_sq"] == spec
    assert desc["specs"][spec]["topology"]["placements"] == ["Shard(dim=0)"]


def test_plan_has_the_shards_the_layout_implies(plan: ZarrSavePlan) -> None:
    params = DIMS.params()
    world = SAVE.world
    # weight, 2 moments, step; the per-rank arrays (issue 40): 2 RNG states and the data-loader position
    assert len(plan.arrays) == 4 * len(params) + 3
    per_tensor = {"dense": SAVE.dp, "expert": SAVE.ep_mp * SAVE.ep_dp}  # Shard(0) over DP; EP-MP x EP-DP boxes
    # weight, 2 moments; a row of each per-rank array per rank. The 0-d step counters are constant
    # arrays: metadata only, no shard to write (a per-rank array never is: its rows differ by rank)
    expected = sum(3 * per_tensor[group] for _, _, group, _ in params) + 3 * world
    assert sum(len(owner) for owner in plan.owners.values()) == expected
    for key in ("rng.cpu", "rng.cuda", "dataloader"):
        meta = plan.arrays[key]
        assert meta.per_rank == "tensor" and meta.shape[0] == world and meta.shard_shape[0] == 1, key
        assert plan.owners[key] == {(r, *(0 for _ in meta.shape[1:])): r for r in range(world)}, key
    constant = {k for k, m in plan.arrays.items() if m.constant is not None}
    assert constant == {f"{key.replace('model.', 'optim.state.model.', 1)}.step" for key, _, _, _ in params}
    assert all(plan.owners[k] == {} for k in constant)
    meta = plan.arrays["model.layers.0.moe.experts.w1"]
    assert meta.shard_shape == (DIMS.experts // SAVE.ep_mp, DIMS.d_model // SAVE.ep_dp, DIMS.d_ff)
    assert meta.topology["holders"] == SAVE.dp and meta.topology["world_size"] == world
    assert plan.arrays["optim.state.model.layers.0.moe.experts.w1.exp_avg"].role == "first_moment"
    assert plan.values["trainer.step"] == ss.STEP and plan.values["optim.param_groups.model.norm.weight.lr"] == 3e-4


def test_every_tensor_is_tiled_exactly_once_by_a_holder(plan: ZarrSavePlan, raws: list[bytes]) -> None:
    descs = sm.decode(raws)
    for key, owner in plan.owners.items():
        meta = plan.arrays[key]
        if meta.constant is not None:
            continue  # no shards
        assert sum(cell_box(idx, meta.shard_shape, meta.shape).volume for idx in owner) == max(1, math.prod(meta.shape))
        for idx, rank in owner.items():
            (spec,) = descs[rank].parts(key)
            cell = cell_box(idx, meta.shard_shape, meta.shape)
            assert spec.box.intersect(cell) == cell, (key, idx, rank)


def test_writers_per_rank(plan: ZarrSavePlan) -> None:
    """Each rank writes its own box of every tensor of its stage and its rows of the 3 per-rank
    arrays; the replicated step counters (constant arrays) are written by no one."""
    writes = Counter(rank for owner in plan.owners.values() for rank in owner.values())
    stage_params = Counter(SAVE.stage_of(DIMS, layer, key) for key, _, _, layer in DIMS.params())
    for rank in range(SAVE.world):
        stage, _ = divmod(rank, SAVE.dp)
        assert writes[rank] == 3 * stage_params[stage] + 3, rank
    assert set(writes) == set(range(SAVE.world))
    assert sum(len(plan.shards_of(r)) for r in range(SAVE.world)) == sum(writes.values())
    docs = [path for r in range(SAVE.world) for path, _ in plan.metadata_of(r)]
    assert len(docs) == len(set(docs)) == len(plan.arrays) + len(group_paths(list(plan.arrays.values())))


@pytest.mark.parametrize("small", [DEFAULT_SMALL_TENSOR_BYTES, 2**20], ids=["default", "1MiB"])
def test_small_tensors_are_written_whole_by_ranks_in_turn(raws: list[bytes], small: int) -> None:
    """As zarrckpt.save plans it: every tensor under ``small`` bytes is one shard, a larger one's shards
    hold at least that much; a joined shard's writer holds part of it and is sent every box it lacks by
    a rank that holds that box; every rank writes, and the bytes are spread over the ranks."""
    descs = sm.decode(raws)
    plan = build_save_plan(descs, DEFAULT_CHUNK_BYTES, small)
    for key, meta in plan.arrays.items():
        if meta.constant is not None:  # step counters, zero RNG placeholders: metadata only
            assert plan.owners[key] == {} and key not in plan.gathers, key
        elif meta.per_rank:  # a row per rank, each written by its rank: never joined
            assert meta.shard_shape[0] == 1 and key not in plan.gathers, key
        elif meta.nbytes < small:
            assert meta.shard_shape == tuple(max(1, n) for n in meta.shape) and len(plan.owners[key]) == 1, key
        elif len(plan.owners[key]) > 1:
            assert math.prod(meta.shard_shape) * meta.itemsize >= small, key
    writes = Counter(rank for owner in plan.owners.values() for rank in owner.values())
    assert set(writes) == set(range(SAVE.world)), writes
    loads = [plan.bytes_of(r) for r in range(SAVE.world)]  # chosen by bytes: by count the most loaded rank
    assert max(loads) <= 1.6 * sum(loads) / SAVE.world, loads  # wrote 3.1x the mean (2.1x with 1 MiB)
    # joined, not whole: the experts (3 MiB in this small model: under the 2 MiB default they join whole)
    assert any(len(shards) > 1 for shards in plan.gathers.values()) == (small == 2**20)
    for key, shards in plan.gathers.items():
        meta = plan.arrays[key]
        for idx, gather in shards.items():
            region = cell_box(idx, meta.shard_shape, meta.shape)
            assert key in descs[gather.writer].tensors and gather.pieces
            for box, sender in gather.pieces:
                assert region.contains(box) and box in {s.box for s in descs[sender].parts(key)}, (key, box, sender)
            own = [s.box.intersect(region) for s in descs[gather.writer].parts(key)]
            held = sum(b.volume for b in own if b is not None)
            assert held + sum(b.volume for b, _ in gather.pieces) == region.volume, (key, idx)


def test_descriptions_survive_the_wire_and_share_specs(raws: list[bytes]) -> None:
    """What a rank sends decodes to an equal description; a weight and its moments share one spec."""
    descs = sm.decode(raws)
    for desc in descs[:8]:
        assert RankDescription.from_json(json.loads(json.dumps(desc.to_json()))) == desc
    desc = descs[5]
    key = "model.layers.0.attn.wqkv"
    assert desc.tensors[key] == desc.tensors[f"optim.state.{key}.exp_avg"] and len(desc.specs) < len(desc.tensors)


def test_a_misdeclared_box_is_caught_although_its_spec_is_shared(raws: list[bytes]) -> None:
    """Rank 5 declares the wqkv of layer 0 one row lower: that key, and only it, is refused, even
    though rank 5's other keys share (and keep) the original spec."""
    descs = sm.decode(raws)
    key = "model.layers.0.attn.wqkv"
    desc = descs[5]
    (spec,) = desc.parts(key)
    lower = Box((spec.box.offsets[0] - 1, *spec.box.offsets[1:]), spec.box.sizes)
    specs = (*desc.specs, dataclasses.replace(spec, box=lower))
    descs[5] = dataclasses.replace(desc, specs=specs, tensors={**desc.tensors, key: (len(desc.specs),)})
    with pytest.raises(SaveLayoutError) as err:
        build_save_plan(descs)
    problems = str(err.value).splitlines()[1:]
    assert problems and all(p.strip().startswith(f"{key}: region") for p in problems), problems
    assert any("claimed twice" in p for p in problems) and any("held by no rank" in p for p in problems)


def test_resharding_load_plan_covers_every_target_region(plan: ZarrSavePlan, raws: list[bytes]) -> None:
    manifest = Manifest.loads(sm.manifest_of(plan), "test")
    for rank in (0, 1, LOAD.world - 1):
        with sm.fake_rank(rank, LOAD.world):
            state = sm.rank_state(DIMS, LOAD, rank)
        requests, _ = sm.load_requests(state, manifest)
        assert requests
        covered: Counter[int] = Counter()
        for task in plan_reads(requests):
            for parts in task.needs.values():
                for part, req in parts:
                    covered[id(req)] += part.volume
        assert all(covered[id(r)] == r.box.volume for r in requests)
    dcp = sm.DcpLayout(sm.decode(raws))
    counts = sm.plan_load(DIMS, LOAD, sm.manifest_of(plan), 1, dcp)
    assert counts.gets >= counts.shard_tasks and counts.bytes_read >= counts.bytes_needed > 0
    # fanned out (the load's default) never reads more than each rank alone would
    assert counts.plain_bytes >= counts.bytes_read and counts.plain_gets >= counts.gets
    assert counts.missing_rng == 0
    assert sum(counts.dcp_bytes) >= counts.bytes_needed and sum(counts.dcp_gets) >= counts.requests
    same = sm.plan_load(DIMS, SAVE, sm.manifest_of(plan), 1, dcp)  # the saved layout: DCP reads each chunk once
    assert sum(same.dcp_bytes) == same.bytes_needed and sum(same.dcp_gets) == same.requests


@pytest.mark.slow  # ~15 s: the whole model at 64 ranks, loads into two layouts
def test_the_report_renders_from_a_small_run() -> None:
    """The scale model end to end at 64 ranks (save, two loads, predictions, DCP beside it): the
    page `benchmarks/results/scale.md` is rendered from, with every target judged."""
    shrink = sm.Layout(pp=1, dp=16, ep_mp=8, ep_dp=2)
    results = sm.run(DIMS, SAVE, {"shrink": shrink, "grow, uneven": LOAD}, 1, None)
    page = sm.render(results)
    assert results.counts.shard_objects > 0 and results.counts.manifest_bytes > 0
    rows = [line for line in page.splitlines() if line.endswith(("| PASS |", "| MISS |"))]
    assert len(rows) >= 4, page
    for heading in ("## ", "DCP"):
        assert heading in page
