"""The scale model for the layout-based planner (``zarrckpt.plan.compact``, issue 28) at 1,024, 4,096 and
16,384 simulated ranks: ``python benchmarks/scale_model.py --compact-scales 1024,4096,16384``."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_model import manifest_and_table, save_counts
from scale_state import Dims, Layout, Timing, fake_rank, measure, per_rank_state, rank_state

from zarrckpt.format.manifest import Manifest
from zarrckpt.plan.localstate import collect
from zarrckpt.plan.save import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES, build_save_plan

# -- issue 28: planning from layouts at 1,024 / 4,096 / 16,384 ranks ----------------------------------------

SCALES = {
    1024: Layout(pp=8, dp=128, ep_mp=64, ep_dp=2),
    4096: Layout(pp=8, dp=512, ep_mp=64, ep_dp=8),
    16384: Layout(pp=16, dp=1024, ep_mp=128, ep_dp=8),
}
# loads of the 16,384-rank checkpoint (issue 28): shrink to 8,192 ranks, grow to 24,576
LOAD_SCALES = {
    "shrink to 8,192": Layout(pp=16, dp=512, ep_mp=128, ep_dp=4),
    "grow to 24,576": Layout(pp=16, dp=1536, ep_mp=128, ep_dp=12),
}


@dataclass
class LoadPlanning:
    """What one loading rank (the last) does before its first read, as ``zarrckpt.load`` does it."""

    name: str
    world: int
    parse: Timing  # Manifest.loads of the broadcast manifest, the broadcast table's checksums attached
    planning: Timing  # match, the flags and view, the read requests and their fetch plans
    requests: int  # this rank's read requests
    fetches: int  # its shard objects to read
    received: dict[str, int]  # per rank, by step
    fanned_out: bool  # whether the load would plan a fan-out (under MAX_GATHERED_REQUESTS in all)


def load_planning(dims: Dims, name: str, layout: Layout, raw: bytes, table: bytes, reps: int) -> LoadPlanning:
    """Time the last rank of ``layout`` planning its load of the manifest ``raw`` (the steps of
    ``zarrckpt.load`` before its first read; the collectives' results sized as they would arrive)."""
    from scale_model import load_requests

    from zarrckpt.engine.fanread import MAX_GATHERED_REQUESTS
    from zarrckpt.plan import targets
    from zarrckpt.plan.fetch import plan_fetches
    from zarrckpt.storage.caps import OBJECT_STORE

    rank, world = layout.world - 1, layout.world
    with fake_rank(rank, world):
        state = rank_state(dims, layout, rank)
    parse_t, manifest = measure(lambda: parse_with_table(raw, table), reps)

    def plan() -> tuple[Any, list[Any], list[Any]]:
        matched = targets.match(state, manifest, rank=rank, world=world, per_rank="modulo")
        saved = targets.saved_keys(manifest)
        requested = matched.requested()
        flags = np.fromiter((k not in requested for k in saved), dtype=np.int64, count=len(saved))
        view = matched.view(set(saved))
        requests, _ = load_requests(state, manifest, rank)
        return [flags, view], requests, plan_fetches(requests, OBJECT_STORE)

    plan_t, (shared, requests, fetches) = measure(plan, reps)
    flags, view = shared
    # the view: every rank of the shrink finds its keys saved (one distinct view); ranks past the
    # saved world lack their per-rank keys, so the views differ and are gathered whole
    missing = len(view["missing"])
    view_bytes = len(json.dumps(view, separators=(",", ":")))
    distinct = missing > 0 and world - manifest.world_size > 256
    fanned = len(requests) * world <= MAX_GATHERED_REQUESTS
    received = {
        "the manifest (rank 0 reads it, a broadcast)": len(raw) + 8,
        "the chunk checksum table (rank 0 reads it, a broadcast)": len(table) + 8,
        "MIN all-reduce of a flag per saved key (int64)": 8 * len(flags),
        "digests of the views (16 bytes per rank)": 16 * world,
        "the views: one broadcast per distinct view, or all gathered": (
            16 * world + view_bytes * world if distinct else view_bytes + 8
        ),
        "MAX of the request counts (fan-out or not)": 8,
        "every rank's requests, when fanned out": 40 * len(requests) * world if fanned else 0,
    }
    return LoadPlanning(name, world, parse_t, plan_t, len(requests), len(fetches), received, fanned)


@dataclass
class CompactScale:
    """One scale's figures for the layout-based planner (``zarrckpt.plan.compact``)."""

    world: int
    classes: int
    gen_s: float
    typical: Timing  # one rank other than 0: split, flags, class docs, local plan (its own share)
    coordinator: Timing  # rank 0: the same plus the whole plan and every rank's payload
    manifest_t: Timing
    received: dict[str, int]  # per non-coordinator rank, by step
    coordinator_received: int
    manifest_bytes: int
    manifest_parts: dict[str, int]  # bytes of its parts: the commit record, the consolidated metadata, ...
    manifest_parse: Timing  # Manifest.loads and the table's checksums attached: what every loading rank does first
    table_bytes: int  # the chunk checksum table beside the manifest (format version 3): a load's second object
    resident: int  # bytes the parsed manifest (table attached) holds in memory on each loading rank
    arrays: int
    shard_objects: int
    puts: int
    fallback: bool
    gather_received: int  # what today's all-gather of descriptions would deliver per rank
    dcp_plan_bytes: int  # DCP: a typical rank's pickled local SavePlan (gathered to the coordinator, scattered back)
    loads: list[LoadPlanning]  # the 16,384-rank checkpoint loaded at other world sizes (at that scale only)


def rank_state_light(dims: Dims, layout: Layout, rank: int) -> dict[str, Any]:
    """The per-rank leaves of :func:`rank_state` only (the rest is its stage leader's)."""
    return per_rank_state(layout, rank)


def simulated_splits(dims: Dims, layout: Layout, full_ranks: Sequence[int]) -> list[Any]:
    """Every rank's ``compact.split``: ``full_ranks`` (each stage's first rank among them) simulated in
    full, the others their stage leader's layouts and common items plus their own per-rank leaves."""
    from zarrckpt.plan import compact

    world = layout.world
    full: dict[int, compact.Split] = {}
    for rank in full_ranks:
        with fake_rank(rank, world):
            full[rank] = compact.split(collect(rank_state(dims, layout, rank)))
    splits: list[compact.Split] = []
    for rank in range(world):
        if rank in full:
            splits.append(full[rank])
            continue
        lead = full[rank - rank % layout.dp]
        own = compact.split(collect(rank_state_light(dims, layout, rank), rank=rank, world=world)).plain
        shared = [it for it in lead.plain if not it[1].startswith(("rng.", "dataloader."))]
        splits.append(compact.Split(lead.layouts, shared + own))
    return splits


def compact_scale(dims: Dims, layout: Layout, reps: int, loads: dict[str, Layout] | None = None) -> CompactScale:
    """Simulate the layout-based planner at ``layout.world`` ranks. The leader of each stage and the
    last rank are simulated in full (meta DTensors under the fake process group, ``collect``,
    ``compact.split``); every other rank's split is its stage leader's layouts and common items plus
    its own per-rank leaves (collected and split for real): by construction of :func:`rank_state`,
    what a full simulation gives (``tests/test_plan_scale_compact.py`` checks it at 64 ranks)."""
    from zarrckpt.plan import compact

    world = layout.world
    start = time.perf_counter()
    splits = simulated_splits(dims, layout, sorted({s * layout.dp for s in range(layout.pp)} | {world - 1}))
    gen_s = time.perf_counter() - start
    digests = [s.digest() for s in splits]
    classes = compact.classes_of(digests)
    docs = [splits[m[0]].doc() for m in classes]
    leaders = [json.loads(d)["plain"] for d in docs]
    flags = np.ones(sum(map(len, leaders)), dtype=np.int64)
    at = 0
    for members, items in zip(classes, leaders, strict=True):
        seg = flags[at : at + len(items)]
        for rank in (
            (members[0], members[-1]) if len(members) > 1 else members
        ):  # the stage's ranks differ only in per-rank leaves
            seg[:] = np.minimum(seg, compact.my_flags(splits[rank], items))
        at += len(items)
    cdocs = compact.class_docs(classes, docs, flags)
    ci_of = {r: i for i, m in enumerate(classes) for r in m}
    privates = [json.loads(compact.wire(compact.own_items(splits[r], cdocs[ci_of[r]]))) for r in range(world)]
    args = (DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES)
    last = world - 1

    def fresh() -> list[compact.ClassDoc]:
        return compact.class_docs(classes, docs, flags)

    def coordinator() -> tuple[Any, list[bytes]]:
        compact.my_flags(splits[0], leaders[0])
        return compact.coordinate(fresh(), privates, world, *args)

    coord_t, (planned, payloads) = measure(coordinator, reps)

    def typical() -> Any:
        mine = splits[last]
        compact.my_flags(mine, leaders[ci_of[last]])
        got = compact.local_plan(fresh(), payloads[last], last, world, *args)
        assert got is not None
        return got.plan.shards_of(last), got.plan.metadata_of(last)

    typical_t, _ = measure(typical, reps)
    fallback = planned is None
    plan = build_save_plan([]) if planned is None else planned.plan  # (never None at these layouts)
    manifest_t, (manifest, table) = measure(lambda: manifest_and_table(plan), 1)
    parse_t, _ = measure(lambda: parse_with_table(manifest, table), 1)
    resident = resident_bytes(lambda: parse_with_table(manifest, table))
    counts = save_counts(plan, manifest, table)
    received = {
        "A. all-gather of 16-byte layout digests": 16 * world,
        "B. one broadcast per class (the classes' documents)": sum(len(d) + 8 for d in docs),
        "C. MIN all-reduce of one flag per class item (int64)": 8 * len(flags),
        "D. gather of per-rank items to rank 0 (its longest length)": 8,
        "E. scatter from rank 0 (zarr.json share, own arrays; padded to the longest)": 16 + max(map(len, payloads)),
        "F. replica check: MIN all-reduce of 2 digests per replicated block": 16 * (planned.blocks if planned else 0),
    }
    longest = max(len(compact.wire(p)) for p in privates)
    desc = json.dumps(collect_desc(dims, layout, last), separators=(",", ":"))
    return CompactScale(
        world=world,
        classes=len(classes),
        gen_s=gen_s,
        typical=typical_t,
        coordinator=coord_t,
        manifest_t=manifest_t,
        received=received,
        coordinator_received=sum(received.values()) + (8 + longest) * world,
        manifest_bytes=len(manifest),
        manifest_parts=manifest_parts(manifest),
        manifest_parse=parse_t,
        table_bytes=len(table),
        resident=resident,
        arrays=counts.arrays,
        shard_objects=counts.shard_objects,
        puts=counts.puts,
        fallback=fallback,
        gather_received=len(desc) * world,
        dcp_plan_bytes=dcp_plan_bytes(dims, layout, last),
        loads=[load_planning(dims, n, lay, manifest, table, reps) for n, lay in (loads or {}).items()],
    )


def manifest_parts(raw: bytes) -> dict[str, int]:
    """About how many bytes of the manifest each part takes (compact JSON of each)."""
    doc = json.loads(raw)

    def size(obj: Any) -> int:
        return len(json.dumps(obj, separators=(",", ":")))

    nodes = doc["consolidated_metadata"]["metadata"]
    record = doc["attributes"]["zarrckpt"]["integrity"]
    return {
        "commit record (`integrity`: per array its shape, digests and segment of the table)": size(record),
        "consolidated metadata (every array's and group's `zarr.json`)": size(nodes),
        "of which the per-rank arrays (`rng/*`, `dataloader`) and their groups": size(
            {k: v for k, v in nodes.items() if k.startswith("rng/") or k in ("rng", "dataloader")}
        ),
        "saved values (`values`)": size(doc["attributes"]["zarrckpt"]["values"]),
    }


def parse_with_table(raw: bytes, table: bytes) -> Manifest:
    """What every loading rank does with the two objects rank 0 read and broadcast (``open_manifest``)."""
    return Manifest.loads(raw, "scale model").with_table(table)


def resident_bytes(build: Any) -> int:
    """Bytes still allocated (tracemalloc) by what ``build`` returns, once it returned: the resident
    cost of a parsed manifest on a rank for the whole load."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = build()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del kept
    return after - before


def collect_desc(dims: Dims, layout: Layout, rank: int) -> Any:
    with fake_rank(rank, layout.world):
        return collect(rank_state(dims, layout, rank)).describe().to_json()


def dcp_plan_bytes(dims: Dims, layout: Layout, rank: int) -> int:
    """DCP's local save plan of ``rank`` (``DefaultSavePlanner``), pickled as ``gather_object`` sends it."""
    import pickle

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict  # noqa: F401

    with fake_rank(rank, layout.world):
        state = rank_state(dims, layout, rank)
        flat = {k: v for k, v in _flat_tensors(state).items()}
        planner = DefaultSavePlanner()
        planner.set_up_planner(flat, is_coordinator=rank == 0)
        return len(pickle.dumps(planner.create_local_plan()))


def _flat_tensors(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_tensors(v, key + "."))
        else:
            out[key] = v
    return out


def compact_main(reps: int, scales: Sequence[int], out: Path) -> None:
    from scale_compact_report import render_compact, splice

    results, section = [], ""
    for world in scales:
        t = time.perf_counter()
        results.append(compact_scale(Dims(), SCALES[world], reps, LOAD_SCALES if world == 16384 else None))
        print(f"{world} ranks: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        section = render_compact(results)  # after each scale: a long run stopped later keeps what it measured
        out.write_text(splice(out.read_text() if out.exists() else "", section))
    print(section)
