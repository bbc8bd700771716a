"""The scale model: zarrckpt's planning at 1,024 ranks for a 166.7B-parameter MoE checkpoint.

Usage::

    python benchmarks/scale_model.py [--reps 3] [--out benchmarks/results/scale.md] [--profile DIR]

One command, no data, no processes, no GPU. It builds the full training state of a 166.7B MoE
transformer (FP32 weights, Adam ``exp_avg`` / ``exp_avg_sq``, per-parameter ``step`` counters,
trainer values, per-rank RNG states) for each of 1,024 simulated ranks, as the real save path
sees it: ``DTensor`` s on the ``meta`` device (no memory) under a fake process group
(``torch.testing._internal.distributed.fake_pg``) that gives each simulated rank its real mesh
coordinate, turned into descriptions by the real ``zarrckpt.plan.localstate.collect(...).describe()``
and JSON-encoded exactly as ``zarrckpt.engine.dist.Group.all_gather_json`` does. It then times the real
planning code (``zarrckpt.plan.save.build_save_plan``, ``ZarrSavePlan.shards_of`` / ``metadata_of``, the
``Manifest``), counts objects, requests and bytes, and plans a resharding load into a different
layout with the real load-side code (``Manifest.loads``, ``zarrckpt.plan.fetch.plan_fetches``).
Finally it predicts save and load times from stated bandwidth and request-rate assumptions.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from zarrckpt.format import integrity
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.dtypes import storage_dtype
from zarrckpt.format.keys import flat_key, iter_leaves
from zarrckpt.format.layout import Box, Shape
from zarrckpt.format.manifest import Manifest, group_paths
from zarrckpt.format.shard import ShardLayout, chunks_per_shard
from zarrckpt.plan import fanout
from zarrckpt.plan.fetch import Request, plan_fetches
from zarrckpt.plan.localstate import collect
from zarrckpt.plan.rankdesc import RankDescription
from zarrckpt.plan.save import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_SMALL_TENSOR_BYTES,
    ZarrSavePlan,
    build_save_plan,
    metadata_shares,
)
from zarrckpt.plan.targets import target_boxes
from zarrckpt.storage.caps import OBJECT_STORE, ReadCaps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_dcp import DcpLayout, DcpSave
from scale_predict import Assumptions, puts_for
from scale_report import render
from scale_state import (
    LOADS,
    SAVE,
    Dims,
    Layout,
    Timing,
    fake_rank,
    gather_descriptions,
    measure,
    rank_state,
)

# -- save: what every rank computes, and what it leads to -------------------------------------------------


def plan_of(descriptions: Sequence[RankDescription]) -> ZarrSavePlan:
    """The plan ``zarrckpt.save`` builds from the gathered descriptions (its default chunk and
    small-tensor sizes)."""
    return build_save_plan(descriptions, DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES)


def decode(raws: Sequence[bytes]) -> list[RankDescription]:
    """What every rank does with the gathered buffers (``Group.all_gather_json``, then ``saveplan.plan_save``)."""
    return [RankDescription.from_json(json.loads(raw)) for raw in raws]


def plan_on_rank(raws: Sequence[bytes], rank: int) -> tuple[ZarrSavePlan, int, int]:
    """Everything a rank computes before writing: decode, plan, its shards and its zarr.json share."""
    plan = plan_of(decode(raws))
    return plan, len(plan.shards_of(rank)), len(plan.metadata_of(rank))


def manifest_of(plan: ZarrSavePlan) -> bytes:
    """The committed root zarr.json (consolidated metadata and the commit record, from what every
    rank reports it wrote), as rank 0 writes it."""
    return manifest_and_table(plan)[0]


def manifest_and_table(plan: ZarrSavePlan) -> tuple[bytes, bytes]:
    """:func:`manifest_of` and the chunk checksum table written beside it (every chunk's crc32c)."""
    written: integrity.Written = {}
    for key, owner in plan.owners.items():
        meta = plan.arrays[key]
        slots = bytes(4 * math.prod(chunks_per_shard(meta.shard_shape, meta.chunk_shape)))  # any values: same size
        written[key] = {integrity.shard_number(meta, idx): slots for idx in owner}
    record, table = integrity.records(plan.arrays, [integrity.to_json(written)])
    manifest = Manifest(
        "0" * 32,
        plan.arrays,
        plan.values,
        plan.world_size,
        "2026-01-01T00:00:00+00:00",
        "zarrckpt",
        integrity=record,
        table_ref=integrity.table_ref(table),
        table=table,
    )
    return manifest.dumps(), table


def object_nbytes(meta: ArrayMeta, idx: Shape) -> int:
    """Size of a shard object (FORMAT.md section 5): index, then every inner chunk inside the array + crc32c."""
    return ShardLayout.of(meta, idx).nbytes


@dataclass
class SaveCounts:
    arrays: int
    groups: int
    shard_objects: int
    docs: int
    data_bytes: int  # elements of every array
    object_bytes: int  # shard objects as stored (index + chunks + crc32c)
    doc_bytes: int
    manifest_bytes: int
    puts: int  # all PUT-class requests, the manifest and pending marker included
    per_rank_bytes: list[int]
    per_rank_puts: list[int]
    objects_by_size: dict[str, int]
    largest_object: int
    small_objects: int  # shard objects under 64 KiB
    small_arrays: int  # arrays whose data is under 64 KiB


SIZE_BINS = [
    (4 * 2**10, "< 4 KiB"),
    (64 * 2**10, "4 - 64 KiB"),
    (2**20, "64 KiB - 1 MiB"),
    (16 * 2**20, "1 - 16 MiB"),
    (math.inf, ">= 16 MiB"),
]


def save_counts(plan: ZarrSavePlan, manifest: bytes, table: bytes = b"") -> SaveCounts:
    world = plan.world_size
    per_bytes, per_puts = [0] * world, [0] * world
    bins = dict.fromkeys((label for _, label in SIZE_BINS), 0)
    largest = objects = 0
    for key, owner in plan.owners.items():
        meta = plan.arrays[key]
        for idx, rank in owner.items():
            n = object_nbytes(meta, idx)
            per_bytes[rank] += n
            per_puts[rank] += puts_for(n)
            bins[next(label for bound, label in SIZE_BINS if n < bound)] += 1
            largest, objects = max(largest, n), objects + 1
    shard_bytes = sum(per_bytes)
    doc_bytes = 0
    shares = metadata_shares(list(plan.arrays.values()), world)  # (metadata_of per rank: world x arrays)
    for rank in range(world):
        for _, doc in shares[rank]:
            per_bytes[rank] += len(doc)
            per_puts[rank] += 1
            doc_bytes += len(doc)
    per_bytes[0] += len(manifest) + len(table)
    per_puts[0] += 3  # the pending marker, the chunk checksum table, then the manifest (commit)
    arrays = list(plan.arrays.values())
    return SaveCounts(
        arrays=len(arrays),
        groups=len(group_paths(arrays)),
        shard_objects=objects,
        docs=len(arrays) + len(group_paths(arrays)),
        data_bytes=sum(a.nbytes for a in arrays),
        object_bytes=shard_bytes,
        doc_bytes=doc_bytes,
        manifest_bytes=len(manifest),
        puts=sum(per_puts),
        per_rank_bytes=per_bytes,
        per_rank_puts=per_puts,
        objects_by_size=bins,
        largest_object=largest,
        small_objects=bins["< 4 KiB"] + bins["4 - 64 KiB"],
        small_arrays=sum(a.nbytes < 64 * 2**10 for a in arrays),
    )


# -- load: a different layout plans its reads from the manifest ----------------------------------------------


def _nowhere(meta: ArrayMeta, box: Box) -> np.ndarray:
    """A destination of the right dtype and shape that takes no memory (planning never touches it)."""
    one = np.empty(1, dtype=storage_dtype(meta.dtype))
    return np.lib.stride_tricks.as_strided(one, shape=box.sizes, strides=(0,) * len(box.sizes))


def load_requests(state: dict[str, Any], manifest: Manifest, rank: int = 0) -> tuple[list[Request], list[str]]:
    """The read requests ``zarrckpt.load`` makes for ``state`` of ``rank`` (one per saved array leaf; a
    per-rank array's row ``rank % saved world``), and its keys."""
    requests, keys = [], []
    for path, value in iter_leaves(state):
        key = flat_key(path)
        keys.append(key)
        meta = manifest.arrays.get(key)
        if meta is not None:
            requests += [Request(meta, box, _nowhere(meta, box)) for box in target_boxes(meta, value, rank)]
    return requests, sorted(keys)


@dataclass
class LoadCounts:
    """One load's reads, as ``zarrckpt.load`` makes them: fanned out (its default; the rows without a
    prefix) and with ``fan_out=False`` (``plain_``)."""

    layout: Layout
    world: int
    requests: int  # read requests (target regions) over all ranks
    shard_tasks: int  # shard objects touched, summed over ranks (and over a rank's read calls)
    gets: int  # data GETs over all ranks (the manifest not included)
    bytes_needed: int
    bytes_read: int
    per_rank_bytes: list[int]
    per_rank_gets: list[int]
    gather_bytes: int  # the load path's all-gathered key lists, summed over ranks
    plan_reads: Timing  # per rank: the most CPU-consuming of the first, middle and last rank
    missing_rng: int
    dcp_gets: list[int]  # per rank: DCP's read items for the same target (one ranged GET each)
    dcp_bytes: list[int]  # per rank: the bytes of the saved chunks those read whole
    manifest_gets: int  # per job: rank 0's read, plus the end-of-load re-read where chunks are not all checked
    fanout_plan: Timing  # fanout.plan over every rank's requests (each rank runs it)
    received: list[int]  # per rank: bytes received from other ranks (fan-out)
    rounds: int
    plain_tasks: int
    plain_gets: int
    plain_bytes: int


NO_READ_THROUGH = replace(OBJECT_STORE, read_through_bytes=0)  # fanned-out items (zarrckpt.engine.fanread)


def _fetches(reqs: Sequence[Request], caps: ReadCaps) -> tuple[int, int, int]:
    """(shard objects touched, GETs, bytes) of one ``read_regions`` call on an object store."""
    planned = plan_fetches([r for r in reqs if r.meta.constant is None], caps)
    return len(planned), sum(len(p.fetches) for p in planned), sum(p.nbytes for p in planned)


def _array_infos(manifest: Manifest) -> tuple[dict[str, int], list[fanout.ArrayInfo]]:
    keys = sorted(manifest.arrays)
    infos = []
    for key in keys:  # as zarrckpt.engine.fanread builds them
        m = manifest.arrays[key]
        infos.append(fanout.ArrayInfo(m.shape, m.shard_shape, m.chunk_shape, m.itemsize, m.constant is not None))
    return {k: n for n, k in enumerate(keys)}, infos


def _fanned_reads(
    plan: fanout.FanOutPlan, rank: int, reqs: Sequence[Request], metas: Sequence[ArrayMeta]
) -> list[tuple[list[Request], ReadCaps]]:
    """The read calls ``zarrckpt.engine.fanread.read_shared`` makes on ``rank``: (requests, caps) each."""
    own = [reqs[i] for i in plan.solo[rank]]
    if plan.solo_parts:
        own += [Request(reqs[i].meta, box, _nowhere(reqs[i].meta, box)) for i, box in plan.solo_parts[rank]]
    calls = [(own, OBJECT_STORE)]
    for n, rnd in enumerate(plan.rounds):
        items = [rnd.items[i] for i in plan.reads(rank, n)]
        calls.append(
            (
                [Request(metas[it.array], it.region, _nowhere(metas[it.array], it.region)) for it in items],
                NO_READ_THROUGH,
            )
        )
    return calls


def plan_load(dims: Dims, layout: Layout, manifest_raw: bytes, reps: int, dcp: DcpLayout) -> LoadCounts:
    manifest = Manifest.loads(manifest_raw, "scale model")
    world = layout.world
    number, infos = _array_infos(manifest)
    metas = [manifest.arrays[k] for k in sorted(manifest.arrays)]
    dcp_gets, dcp_bytes = [0] * world, [0] * world
    needed = gathered = missing = plain_tasks = plain_gets = plain_bytes = 0
    slowest = Timing(0.0, 0.0)
    all_reqs: list[list[Request]] = []
    for rank in range(world):
        with fake_rank(rank, world):
            state = rank_state(dims, layout, rank)
        reqs, keys = load_requests(state, manifest, rank)
        all_reqs.append(reqs)
        missing += sum(1 for k in keys if k.startswith("rng.") and k not in manifest.arrays)
        if rank in (0, world // 2, world - 1):  # timed on a few ranks (every rank plans the same kind of work)
            timing, _ = measure(lambda reqs=reqs: plan_fetches(reqs, OBJECT_STORE), reps)
            slowest = max(slowest, timing, key=lambda t: t.cpu)
        tasks, gets, nbytes = _fetches(reqs, OBJECT_STORE)  # fan_out=False: each rank reads its own
        plain_tasks, plain_gets, plain_bytes = plain_tasks + tasks, plain_gets + gets, plain_bytes + nbytes
        dcp_gets[rank], dcp_bytes[rank] = dcp.reads(reqs)
        needed += sum(r.box.volume * r.meta.itemsize for r in reqs)
        gathered += len(json.dumps({"keys": keys, "mismatches": []}, separators=(",", ":")))
    wants = [[(number[r.meta.key], r.box) for r in reqs] for reqs in all_reqs]
    fan_t, plan = measure(
        lambda: fanout.plan(wants, infos, join_bytes=OBJECT_STORE.max_request_bytes), max(1, reps // 3)
    )
    per_bytes, per_gets, received = [0] * world, [0] * world, [0] * world
    tasks_all = 0
    for rank in range(world):
        for reqs, caps in _fanned_reads(plan, rank, all_reqs[rank], metas):
            tasks, gets, nbytes = _fetches(reqs, caps)
            tasks_all, per_gets[rank], per_bytes[rank] = (
                tasks_all + tasks,
                per_gets[rank] + gets,
                per_bytes[rank] + nbytes,
            )
    for rnd in plan.rounds:
        for msg in rnd.messages:
            for dst in msg.dsts:
                received[dst] += msg.nbytes
    return LoadCounts(
        layout=layout,
        world=world,
        requests=sum(len(r) for r in all_reqs),
        shard_tasks=tasks_all,
        gets=sum(per_gets),
        bytes_needed=needed,
        bytes_read=sum(per_bytes),
        per_rank_bytes=per_bytes,
        per_rank_gets=per_gets,
        gather_bytes=gathered,
        plan_reads=slowest,
        missing_rng=missing,
        dcp_gets=dcp_gets,
        dcp_bytes=dcp_bytes,
        manifest_gets=1 + (not integrity.reads_are_checked(list(manifest.arrays.values()), any_layout=False)),
        fanout_plan=fan_t,
        received=received,
        rounds=len(plan.rounds),
        plain_tasks=plain_tasks,
        plain_gets=plain_gets,
        plain_bytes=plain_bytes,
    )


@dataclass
class Results:
    dims: Dims
    save: Layout
    reps: int
    generate_s: float
    describe: Timing  # one rank's collect(state).describe(), JSON-encoded
    raws: list[int]  # description bytes per rank
    per_rank: Timing
    coordinator: Timing
    decode: Timing
    build: Timing
    own_share: Timing
    manifest_build: Timing
    manifest_parse: Timing
    counts: SaveCounts
    loads: dict[str, LoadCounts]
    assumptions: Assumptions
    dcp: DcpSave


# -- main -------------------------------------------------------------------------------------------------------


def run(dims: Dims, save: Layout, loads: dict[str, Layout], reps: int, profile: Path | None) -> Results:
    start = time.perf_counter()
    raws = gather_descriptions(dims, save)
    generate_s = time.perf_counter() - start
    last = save.world - 1
    with fake_rank(last, save.world):
        state = rank_state(dims, save, last)
        describe_t, _ = measure(lambda: json.dumps(collect(state).describe().to_json(), separators=(",", ":")), reps)
    per_rank, _ = measure(lambda: plan_on_rank(raws, last), reps)
    coordinator, _ = measure(lambda: manifest_of(plan_on_rank(raws, 0)[0]), reps)
    decode_t, descs = measure(lambda: decode(raws), reps)
    build_t, plan = measure(partial(plan_of, descs), reps)
    own_t, _ = measure(lambda: (plan.shards_of(last), plan.metadata_of(last)), reps)
    manifest_t, manifest = measure(lambda: manifest_of(plan), reps)
    parse_t, _ = measure(lambda: Manifest.loads(manifest, "scale model"), reps)
    dcp = DcpLayout(descs)
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        prof = cProfile.Profile()
        prof.runcall(lambda: manifest_of(plan_on_rank(raws, 0)[0]))
        prof.dump_stats(profile / "scale_plan.pstats")
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(40)
        (profile / "scale_plan.txt").write_text(out.getvalue())
    return Results(
        dims=dims,
        save=save,
        reps=reps,
        generate_s=generate_s,
        describe=describe_t,
        raws=[len(x) for x in raws],
        per_rank=per_rank,
        coordinator=coordinator,
        decode=decode_t,
        build=build_t,
        own_share=own_t,
        manifest_build=manifest_t,
        manifest_parse=parse_t,
        counts=save_counts(plan, manifest),
        loads={name: plan_load(dims, lay, manifest, reps, dcp) for name, lay in loads.items()},
        assumptions=Assumptions(ranks_per_node=save.ranks_per_node),
        dcp=dcp.save(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each timed step (medians are reported)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "scale.md")
    parser.add_argument(
        "--profile", type=Path, default=None, help="write a cProfile of the coordinator's planning here"
    )
    parser.add_argument(
        "--compact-scales", default="", help="only the layout-based planner at these world sizes (1024,4096,16384)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.compact_scales:
        from scale_compact import compact_main  # (it imports this module)

        compact_main(args.reps, [int(w) for w in args.compact_scales.split(",")], args.out)
        return
    results = run(Dims(), SAVE, LOADS, args.reps, args.profile)
    text = render(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
