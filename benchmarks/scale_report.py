"""The scale model's report: the markdown page, with times predicted by ``scale_predict``.

Imported by ``benchmarks/scale_model.py`` (which computes the counts and timings); it reads them
from the ``Results`` it is given and imports nothing of the model.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import torch
from scale_predict import GB, puts_for, transfer

from zarrckpt.plan.save import DEFAULT_SMALL_TENSOR_BYTES
from zarrckpt.storage.caps import OBJECT_REQUEST_BYTES, READ_THROUGH_BYTES

GiB = 2**30
Results = Any  # scale_model.Results (not imported: scale_model runs as __main__)


# -- the report -------------------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / GiB:,.1f} GiB"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    out = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
    ]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


BEFORE_MEASURED = """\
**Before the planning changes of this issue** (zarrckpt at commit 986be65: a full description per
tensor and rank; each tensor's agreement, coverage, grid and writers computed separately), run side
by side with the current code on the same 1,024 descriptions (medians of 3, two runs each):
gathered descriptions 80.8 MB; decoding them 3.1-4.2 s (3.1 s CPU); `build_save_plan` 6.9-7.7 s
(6.8 s CPU); **one rank's planning 10.7-12.6 s wall (9.9 s CPU), over the 10 s budget**. The
current code in the same runs: 41.0 MB, 0.4-0.7 s, 0.4-0.8 s, 1.0-1.7 s (0.96 s CPU). The profile
before: per-field `json.dumps` comparisons across holders (1.2 M calls), `coverage_problems` run
4,108 times on up to 128 boxes (`Box.ends` recomputed 1.8 M times), and cyclic garbage
collections rescanning the decoded descriptions (a third of decode and planning time)."""


def render(r: Results) -> str:
    d, a, c, w = r.dims, r.assumptions, r.counts, r.save.world
    p = d.n_params
    lines = [
        f"# Scale model: a {d.n_params / 1e9:.1f}B-parameter MoE checkpoint at {w:,} ranks",
        "",
        f"`python benchmarks/scale_model.py` ({datetime.now(UTC):%Y-%m-%d}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs shared with other jobs). Nothing is written or sent: "
        f"{w:,} ranks are simulated in one process (meta-device DTensors under a fake process group), their "
        "descriptions come from the real `collect(state).describe()`, and the real planning code runs on them. "
        f"Times are medians of {r.reps} repetitions; wall time is noisy on this shared machine, CPU time less so.",
        "",
        "## Summary",
        "",
        *_summary(r),
        "",
        "## Targets (issue 15)",
        "",
        *_table(["target", "measured", ""], targets(r)),
        "",
        "## Model",
        "",
        *_table(
            ["dimension", "value"],
            [
                ["layers (all MoE, no dense FFN layers)", d.layers],
                ["d_model", d.d_model],
                ["attention heads x head dim (GQA KV heads)", f"{d.heads} x {d.head_dim} ({d.kv_heads})"],
                ["routed experts per layer, top-k", f"{d.experts}, top-{d.top_k}"],
                ["expert FFN width (SwiGLU: w1, w3 [E, d, f], w2 [E, f, d])", d.d_ff],
                ["vocabulary (untied embedding and output head)", f"{d.vocab:,}"],
                ["parameters (active per token)", f"{p / 1e9:,.3f}B ({d.active_params / 1e9:,.1f}B)"],
                ["of which experts", f"{sum(math.prod(s) for _, s, g, _ in d.params() if g == 'expert') / 1e9:,.1f}B"],
            ],
        ),
        "",
        "Saved per parameter tensor: the FP32 weight, Adam `exp_avg` and `exp_avg_sq` (FP32, same layout), and "
        "a 0-d `step` tensor (as `torch.optim.Adam` keeps it). Plus trainer values (step, tokens, epoch, a config "
        "dict), LR-scheduler values, the flattened optimizer `param_groups` (6 hyperparameters per parameter, as "
        "`get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)` produces), a data-loader position per "
        "DP rank, and each rank's RNG states as `bytes` (5,056-byte CPU generator state, 16-byte CUDA state).",
        "",
        "## Layouts",
        "",
        *_table(
            ["", "ranks", "PP", "per stage", "dense parameters", "experts"],
            [
                [
                    name,
                    f"{lay.world:,}",
                    lay.pp,
                    lay.dp,
                    f"`Shard(0)` over DP {lay.dp}",
                    f"EP-MP {lay.ep_mp} (`Shard(0)`, {d.experts // lay.ep_mp} experts) x EP-DP {lay.ep_dp} "
                    "(`Shard(1)`, sharded)",
                ]
                for name, lay in [("save", r.save), *((f"load: {k}", v) for k, v in r.loads.items())]
                for lay in [getattr(lay, "layout", lay)]
            ],
        ),
        "",
        "Ranks are stage-major (rank = stage x per-stage + DP rank); the DP ranks of a stage also form the "
        "EP-MP x EP-DP expert mesh. Layers are split evenly over stages; the embedding sits on the first stage, "
        f"the final norm and output head on the last. {r.save.ranks_per_node} ranks per node.",
        "",
        f"## Planning time (save, {w:,} ranks)",
        "",
        "Every rank gathers all descriptions (`Group.all_gather_json`), decodes them and builds the whole plan "
        "(coverage check, shard grids, writers), then takes its own shards (`ZarrSavePlan.shards_of`) and its share of "
        "`zarr.json` documents (`ZarrSavePlan.metadata_of`). The coordinator (rank 0) also builds the manifest. "
        "Budget: 10 s.",
        "",
        *_table(
            ["step", "time (wall, CPU)"],
            [
                ["(before the gather) `collect(state).describe()` of the rank's own state", r.describe],
                ["decode the gathered descriptions", r.decode],
                ["`build_save_plan`", r.build],
                ["`shards_of` + `metadata_of` (own share)", r.own_share],
                ["**one rank, all of the above**", f"**{r.per_rank}**"],
                ["manifest (`Manifest(...).dumps()`)", r.manifest_build],
                ["**coordinator (rank 0), all of the above**", f"**{r.coordinator}**"],
                [f"(not planning) simulating the {w:,} ranks' state dicts and `describe()`", f"{r.generate_s:.0f} s"],
            ],
        ),
        "",
        BEFORE_MEASURED,
        "",
        *_table(
            ["all-gathered descriptions", "bytes"],
            [
                [
                    "one rank's description (min / median / max)",
                    f"{min(r.raws):,} / {int(statistics.median(r.raws)):,} / {max(r.raws):,}",
                ],
                [f"all {w:,} (what each rank decodes)", _mb(sum(r.raws))],
                ["received per rank (`all_gather` pads to the longest)", _mb(max(r.raws) * len(r.raws))],
            ],
        ),
        "",
        "## Objects, requests and bytes per checkpoint (save)",
        "",
        *_table(
            ["", "count / bytes"],
            [
                [f"arrays (global tensors, incl. {2 * w:,} per-rank RNG `bytes`)", f"{c.arrays:,}"],
                ["shard objects (one per rank's box; one PUT each)", f"{c.shard_objects:,}"],
                ["`zarr.json` documents (arrays + groups)", f"{c.docs:,} ({c.arrays:,} + {c.groups:,})"],
                ["PUT requests (shards, documents, pending marker, manifest)", f"{c.puts:,}"],
                ["PUTs by the busiest rank", f"{max(c.per_rank_puts):,}"],
                ["manifest (root `zarr.json`, consolidated metadata)", _mb(c.manifest_bytes)],
                ["`zarr.json` documents in all", _mb(c.doc_bytes)],
                ["12 x parameters (FP32 weight + 2 Adam moments)", f"{12 * p:,} B = {_gib(12 * p)}"],
                [
                    "array data (all elements, step counters and RNG included)",
                    f"{c.data_bytes:,} B = {_gib(c.data_bytes)}",
                ],
                [
                    "shard objects as stored (index + crc32c per chunk)",
                    f"{c.object_bytes:,} B (x{c.object_bytes / (12 * p):.6f} of 12P)",
                ],
                ["everything written", f"{_gib(c.object_bytes + c.doc_bytes + c.manifest_bytes)}"],
                ["bytes written by the busiest rank (rank with the embedding or head)", _gib(max(c.per_rank_bytes))],
                ["bytes written per rank (median)", _gib(statistics.median(c.per_rank_bytes))],
                ["largest object", _mb(c.largest_object)],
            ],
        ),
        "",
        "Shard objects by size: "
        + ", ".join(f"{label}: {n:,}" for label, n in c.objects_by_size.items())
        + f". Shards under {_small_mib()} MiB are joined (`small_tensor_bytes`): FSDP's `Shard(0)` of a "
        f"{d.d_model:,}-element norm weight over {r.save.dp} ranks is one object, a router's 1-row shards become "
        f"shards of {-(-DEFAULT_SMALL_TENSOR_BYTES // (4 * d.d_model))} rows; "
        f"{c.small_arrays:,} arrays are under 64 KiB in all (the objects under 64 KiB are such arrays: per-rank "
        "RNG states).",
        "",
        "## Loading into a different layout (resharding)",
        "",
        "Each target rank builds its read requests from the manifest (as `zarrckpt.load` does); the real "
        "`zarrckpt.plan.fanout.plan` runs on every rank's requests (the load's default, `fan_out=True`: a shard object "
        "that several ranks need parts of in pieces is read once, by one of them, who sends each the rest), and "
        "each rank plans its read calls (its own requests, then what it reads in each round) "
        "with the real `zarrckpt.plan.fetch.plan_fetches` (object-store capabilities): one GET per planned fetch (the "
        f"whole object in one GET when it is <= {_mib(OBJECT_REQUEST_BYTES)} MiB and all of it is needed, or when "
        "it is <= 1 MiB; else its index plus one ranged GET per run of needed inner chunks, a gap of at most "
        f"{_mib(READ_THROUGH_BYTES)} MiB between two needed chunks read through, <= "
        f"{_mib(OBJECT_REQUEST_BYTES)} MiB per GET; with the commit record in the manifest, as here, no index "
        "GET: each chunk is checked against its committed crc32c).",
        "",
        *_table(
            ["", *r.loads],
            [
                ["ranks", *(f"{x.world:,}" for x in r.loads.values())],
                ["read requests (target regions)", *(f"{x.requests:,}" for x in r.loads.values())],
                ["shards touched (tasks, summed over ranks)", *(f"{x.shard_tasks:,}" for x in r.loads.values())],
                ["data GET requests", *(f"{x.gets:,}" for x in r.loads.values())],
                ["GETs by the busiest rank", *(f"{max(x.per_rank_gets):,}" for x in r.loads.values())],
                ["bytes needed", *(_gib(x.bytes_needed) for x in r.loads.values())],
                ["bytes read", *(_gib(x.bytes_read) for x in r.loads.values())],
                ["bytes read / bytes needed", *(f"{x.bytes_read / x.bytes_needed:.4f}" for x in r.loads.values())],
                [
                    "fan-out: shard objects read once for several ranks (rounds), bytes received from other ranks",
                    *(f"{x.rounds} rounds, {_gib(sum(x.received))}" for x in r.loads.values()),
                ],
                ["fan-out: bytes received by the busiest rank", *(_gib(max(x.received)) for x in r.loads.values())],
                [
                    "fan-out: `fanout.plan` of every rank's requests (every rank runs it)",
                    *(str(x.fanout_plan) for x in r.loads.values()),
                ],
                [
                    "with `fan_out=False`: shards touched, GETs, bytes read / needed",
                    *(
                        f"{x.plain_tasks:,}, {x.plain_gets:,}, {x.plain_bytes / x.bytes_needed:.4f}"
                        for x in r.loads.values()
                    ),
                ],
                [
                    "manifest GETs per job (rank 0 reads it and broadcasts it; every chunk is checked against "
                    "the commit record, so no end-of-load re-read)",
                    *(f"{x.manifest_gets}" for x in r.loads.values()),
                ],
                ["all-gathered key lists (load's `all_gather_json`)", *(_mb(x.gather_bytes) for x in r.loads.values())],
                [
                    "`plan_fetches` on one rank (the slowest of the first, middle and last)",
                    *(str(x.plan_reads) for x in r.loads.values()),
                ],
                [
                    "parse the manifest (`Manifest.loads`), every rank",
                    *(str(r.manifest_parse) for _ in r.loads),
                ],
                ["RNG keys of the target not in the checkpoint", *(f"{x.missing_rng:,}" for x in r.loads.values())],
            ],
        ),
        "",
        "## Predicted save and load time",
        "",
        f"Assumptions: {a.ranks_per_node} ranks per node, {a.node_bandwidth / GB:g} GB/s per node to the object "
        f"store in each direction; {a.latency * 1e3:g} ms to first byte per request, {a.in_flight} requests in "
        f"flight per rank (zarrckpt's default for object stores); an S3 prefix partition sustains "
        f"{a.put_rate:,.0f} PUT/s and {a.get_rate:,.0f} GET/s. *Scaled*: the bucket's request rate does not bind "
        "(S3 partitions busy prefixes; every array is its own prefix). *One partition*: all requests go through "
        "one partition, as for a fresh bucket before S3 re-partitions it. Transfer time = max(the busiest node's "
        "bytes / node bandwidth, the busiest rank's requests x latency / in-flight), and with one partition at "
        "least all requests / partition rate. A load's fan-out transfers between ranks (one rank reads a shard "
        f"object several ranks need for all of them) move at {a.exchange_bandwidth / GB:g} GB/s per node (the "
        "busiest node's received bytes), added to the transfer time although they overlap the next round's "
        "reads. Checksums, staging copies and the commit barrier are not modelled.",
        "",
        *_prediction_table(r),
        "",
        *_dcp_section(r),
        "",
        "## Caveats",
        "",
        "- Planning times are measured on 2 shared CPU cores and taken as medians; a training node's core is "
        "typically faster. The all-gather itself (each rank receives the padded descriptions) is not timed.",
        "- The load-side timings cover planning only (manifest parse, `plan_fetches`); they do not include "
        "building the target state dict or the key comparison `zarrckpt.load` does.",
        f"- Object counts follow from the layout: one object per distinct rank box, except boxes under "
        f"{_small_mib()} MiB (joined: a tensor under it is one object). A joined shard is then read whole by "
        "every rank that needs part of it when small. Bytes read exceed bytes needed there, and where one GET "
        "reads through the gap between two needed runs of an object: in the shrink, every expert shard (2 "
        "experts x half their rows) is needed by two ranks, each wanting a quarter of each expert's rows -- "
        "two runs a quarter of the object apart, read in one GET of three quarters of it. Requests, not bytes, "
        "are what one partition bounds; with the request rate scaled, the extra bytes cost bandwidth.",
        "- The DCP column models its algorithm (whole saved chunks per overlapping read item, `.metadata` on "
        "every rank, one request in flight), not a run of DCP; its planning collectives are not included.",
        "- Predictions are first-order (bandwidth, latency, request rate); real object stores add throttling "
        "retries (zarrckpt retries with backoff) and tail latency.",
    ]
    return "\n".join(lines) + "\n"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def targets(r: Results) -> list[list[str]]:
    """Issue 15's scale targets: [target, measured, verdict]."""
    c, shrink = r.counts, r.loads["shrink"]
    per_object = shrink.gets / shrink.shard_tasks
    dcp_puts = sum(puts_for(n) for n in r.dcp.per_rank_files) + puts_for(r.dcp.metadata_bytes)
    return [
        ["shard objects <= 100,000", f"{c.shard_objects:,}", verdict(c.shard_objects <= 100_000)],
        [
            "objects < 64 KiB <= arrays under 64 KiB",
            f"{c.small_objects:,} vs {c.small_arrays:,}",
            verdict(c.small_objects <= c.small_arrays),
        ],
        [
            f"load into {shrink.world:,} ranks: <= 1.1 GETs per object touched (per rank)",
            f"{per_object:.2f} ({shrink.gets:,} GETs, {shrink.shard_tasks:,} objects touched)",
            verdict(per_object <= 1.1),
        ],
        [
            "manifest GETs per job = 1",
            f"{shrink.manifest_gets} (rank 0, broadcast)",
            verdict(shrink.manifest_gets == 1),
        ],
        [
            "(the bench's target, here at scale) PUTs per save <= 3x DCP's file-per-rank layout",
            f"{c.puts / dcp_puts:.2f}x ({c.puts:,} vs {dcp_puts:,})",
            verdict(c.puts <= 3 * dcp_puts),
        ],
    ]


def _dcp_section(r: Results) -> list[str]:
    a, c, x = r.assumptions, r.counts, r.dcp
    sequential = dataclasses.replace(a, in_flight=1)  # FsspecWriter (1 thread) and FsspecReader read one at a time
    dcp_puts = [puts_for(n) for n in x.per_rank_files]
    dcp_puts[0] += puts_for(x.metadata_bytes)
    dcp_bytes = list(x.per_rank_bytes)
    dcp_bytes[0] += x.metadata_bytes
    ours = transfer(c.per_rank_bytes, c.per_rank_puts, a.put_rate, a)
    theirs = transfer(dcp_bytes, dcp_puts, a.put_rate, sequential)
    rows = [
        ["objects per checkpoint", f"{c.shard_objects + c.docs + 1:,}", f"{x.files:,}"],
        ["PUT requests per save", f"{c.puts:,}", f"{sum(dcp_puts):,}"],
        ["metadata", _mb(c.manifest_bytes), _mb(x.metadata_bytes)],
        ["metadata a load reads", f"{_mb(c.manifest_bytes)} (rank 0 only)", f"{_mb(x.metadata_bytes)} x every rank"],
        [
            "save, scaled / one partition",
            f"{ours.scaled:.1f} s / {ours.worst:.1f} s",
            f"{theirs.scaled:.1f} s / {theirs.worst:.1f} s",
        ],
    ]
    for name, load in r.loads.items():
        m = load.manifest_gets
        gets = [g + (m if rank == 0 else 0) for rank, g in enumerate(load.per_rank_gets)]
        nbytes = [b + (m * c.manifest_bytes if rank == 0 else 0) for rank, b in enumerate(load.per_rank_bytes)]
        mine = transfer(nbytes, gets, a.get_rate, a)
        dgets = [g + 1 for g in load.dcp_gets]  # every rank reads .metadata
        dbytes = [b + x.metadata_bytes for b in load.dcp_bytes]
        dcp = transfer(dbytes, dgets, a.get_rate, sequential)
        rows += [
            [f"load {name}: GETs", f"{sum(gets):,}", f"{sum(dgets):,}"],
            [
                f"load {name}: bytes read / needed",
                f"{load.bytes_read / load.bytes_needed:.3f}",
                f"{sum(load.dcp_bytes) / load.bytes_needed:.3f}",
            ],
            [
                f"load {name}, scaled / one partition",
                f"{mine.scaled:.1f} s / {mine.worst:.1f} s",
                f"{dcp.scaled:.1f} s / {dcp.worst:.1f} s",
            ],
        ]
    return [
        "## Side by side: DCP's file-per-rank layout under the same model",
        "",
        "`dcp.save` through `FsspecWriter` (one writer thread): each rank writes one file of its deduplicated "
        "items (a replicated item goes to its least loaded holder) and the coordinator a pickled `.metadata` "
        f"(listing {x.chunks:,} chunks; its size measured by pickling the real DCP `Metadata` "
        "of this checkpoint). `dcp.load` through `FsspecReader`: every rank reads `.metadata`, then reads every "
        "saved chunk overlapping a target region whole, one request at a time. Same assumptions as above, with "
        "one request in flight per rank for DCP; transfer only (planning not included on either side).",
        "",
        *_table(["", "zarrckpt", "DCP (file per rank)"], rows),
    ]


def _summary(r: Results) -> list[str]:
    a, c = r.assumptions, r.counts
    save = transfer(c.per_rank_bytes, c.per_rank_puts, a.put_rate, a)
    out = [
        f"- Planning a save at {r.save.world:,} ranks: {r.per_rank.wall:.1f} s per rank ({r.per_rank.cpu:.1f} s CPU), "
        f"{r.coordinator.wall:.1f} s at the coordinator ({r.coordinator.cpu:.1f} s CPU) -- budget 10 s (before this "
        "issue's changes: 10.7-12.6 s).",
        f"- Gathered descriptions: {_mb(sum(r.raws))}. Manifest: {_mb(c.manifest_bytes)} for {c.arrays:,} arrays.",
        f"- One checkpoint: {c.shard_objects:,} shard objects, {c.puts:,} PUTs, "
        f"{_gib(c.object_bytes + c.doc_bytes + c.manifest_bytes)} written = "
        f"{(c.object_bytes + c.doc_bytes + c.manifest_bytes) / (12 * r.dims.n_params):.5f} x 12P.",
    ]
    for name, x in r.loads.items():
        out.append(
            f"- Load into {x.world:,} ranks ({name}): {x.gets:,} GETs, bytes read / needed "
            f"{x.bytes_read / x.bytes_needed:.3f}."
        )
    out.append(
        f"- Predicted at {a.node_bandwidth / GB:g} GB/s per node: save {r.per_rank.wall + save.scaled:.0f} s when the "
        f"store's request rate does not bind, {r.per_rank.wall + save.worst:.0f} s through one S3 prefix "
        "partition -- the object count, not the bytes, is the risk."
    )
    return out


def _prediction_table(r: Results) -> list[str]:
    a, c = r.assumptions, r.counts
    save = transfer(c.per_rank_bytes, c.per_rank_puts, a.put_rate, a)
    rows = [
        [
            f"save ({r.save.world:,} ranks)",
            f"{r.per_rank.wall:.1f} s",
            f"{save.bandwidth:.1f} s",
            f"{save.latency:.1f} s",
            f"{save.one_partition:.1f} s",
            "-",
            f"**{r.per_rank.wall + save.scaled:.1f} s**",
            f"**{r.per_rank.wall + save.worst:.1f} s**",
        ]
    ]
    for name, x in r.loads.items():
        # + the manifest on rank 0, broadcast to the others
        m = x.manifest_gets
        gets = [g + (m if rank == 0 else 0) for rank, g in enumerate(x.per_rank_gets)]
        nbytes = [b + (m * c.manifest_bytes if rank == 0 else 0) for rank, b in enumerate(x.per_rank_bytes)]
        load = transfer(nbytes, gets, a.get_rate, a)
        plan = r.manifest_parse.wall + x.plan_reads.wall + x.fanout_plan.wall
        nodes = range(0, x.world, a.ranks_per_node)
        exchange = max(sum(x.received[n : n + a.ranks_per_node]) for n in nodes) / a.exchange_bandwidth
        rows.append(
            [
                f"load: {name} ({x.world:,} ranks)",
                f"{plan:.1f} s",
                f"{load.bandwidth:.1f} s",
                f"{load.latency:.1f} s",
                f"{load.one_partition:.1f} s",
                f"{exchange:.1f} s",
                f"**{plan + load.scaled + exchange:.1f} s**",
                f"**{plan + load.worst + exchange:.1f} s**",
            ]
        )
    return _table(
        [
            "",
            "planning (measured)",
            "bandwidth",
            "latency",
            "request rate, one partition",
            "exchange between ranks",
            "total, scaled",
            "total, one partition",
        ],
        rows,
    )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:g}"


def _small_mib() -> str:
    return f"{DEFAULT_SMALL_TENSOR_BYTES / 2**20:g}"
