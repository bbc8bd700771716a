"""The scale model: zarrckpt's planning at 1,024 ranks for a 166.7B-parameter MoE checkpoint.

Usage::

    python benchmarks/scale_model.py [--reps 3] [--out benchmarks/results/scale.md] [--profile DIR]

One command, no data, no processes, no GPU. It builds the full training state of a 166.7B MoE
transformer (FP32 weights, Adam ``exp_avg`` / ``exp_avg_sq``, per-parameter ``step`` counters,
trainer values, per-rank RNG states) for each of 1,024 simulated ranks, as the real save path
sees it: ``DTensor`` s on the ``meta`` device (no memory) under a fake process group
(``torch.testing._internal.distributed.fake_pg``) that gives each simulated rank its real mesh
coordinate, turned into descriptions by the real ``zarrckpt.localstate.collect(...).describe()``
and JSON-encoded exactly as ``zarrckpt.dist.Group.all_gather_json`` does. It then times the real
planning code (``zarrckpt.plan.build_save_plan``, ``ZarrSavePlan.shards_of`` / ``metadata_of``, the
``Manifest``), counts objects, requests and bytes, and plans a resharding load into a different
layout with the real load-side code (``Manifest.loads``, ``zarrckpt.fetch.plan_fetches``).
Finally it predicts save and load times from stated bandwidth and request-rate assumptions.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import math
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from zarrckpt import integrity
from zarrckpt.api import target_boxes
from zarrckpt.dtypes import storage_dtype
from zarrckpt.fetch import Request, plan_fetches
from zarrckpt.format import ArrayMeta, Manifest, group_paths
from zarrckpt.keys import flat_key, iter_leaves
from zarrckpt.layout import Box, Shape
from zarrckpt.localstate import collect
from zarrckpt.plan import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES, ZarrSavePlan, build_save_plan
from zarrckpt.rankdesc import RankDescription
from zarrckpt.shard import ShardLayout, chunks_per_shard
from zarrckpt.storecaps import OBJECT_STORE

GB = 1e9
GiB = 2**30
S3_MULTIPART_CHUNK = 50 * 2**20  # s3fs pipe_file: one PUT below 2 x 50 MiB, else multipart of 50 MiB parts


# -- the model --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dims:
    """A fine-grained MoE transformer (SwiGLU experts, GQA attention, untied embeddings)."""

    layers: int = 64
    d_model: int = 5120
    heads: int = 40
    kv_heads: int = 8
    head_dim: int = 128
    experts: int = 128  # routed experts per layer, every layer is MoE (no dense FFN layers)
    top_k: int = 8
    d_ff: int = 1280  # expert FFN width
    vocab: int = 151936

    def params(self) -> list[tuple[str, tuple[int, ...], str, int | None]]:
        """``(key, global shape, group, layer)`` of every parameter; group is dense | expert."""
        d, qkv = self.d_model, (self.heads + 2 * self.kv_heads) * self.head_dim
        out: list[tuple[str, tuple[int, ...], str, int | None]] = [
            ("model.embed.weight", (self.vocab, d), "dense", None)
        ]
        for i in range(self.layers):
            p = f"model.layers.{i}"
            out += [
                (f"{p}.attn_norm.weight", (d,), "dense", i),
                (f"{p}.attn.wqkv", (qkv, d), "dense", i),
                (f"{p}.attn.wo", (d, self.heads * self.head_dim), "dense", i),
                (f"{p}.ffn_norm.weight", (d,), "dense", i),
                (f"{p}.moe.router.weight", (self.experts, d), "dense", i),
                (f"{p}.moe.experts.w1", (self.experts, d, self.d_ff), "expert", i),
                (f"{p}.moe.experts.w2", (self.experts, self.d_ff, d), "expert", i),
                (f"{p}.moe.experts.w3", (self.experts, d, self.d_ff), "expert", i),
            ]
        out += [("model.norm.weight", (d,), "dense", None), ("model.output.weight", (self.vocab, d), "dense", None)]
        return out

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for _, s, _, _ in self.params())

    @property
    def active_params(self) -> int:
        per = {g: 0 for g in ("dense", "expert")}
        for _, s, g, _ in self.params():
            per[g] += math.prod(s)
        return per["dense"] + per["expert"] * self.top_k // self.experts


@dataclass(frozen=True)
class Layout:
    """``world = pp * dp`` ranks; per pipeline stage, ``dp`` ranks shard every dense parameter
    ``Shard(0)`` (FSDP-style), and the same ranks form an ``ep_mp x ep_dp`` expert mesh: experts
    split over ``ep_mp`` (``Shard(0)``), each expert's weights (and Adam state) sharded over
    ``ep_dp`` along dim 1 (ZeRO-style, not replicated). Stages own contiguous blocks of layers;
    the embedding sits on the first stage, the final norm and output head on the last."""

    pp: int
    dp: int
    ep_mp: int
    ep_dp: int
    ranks_per_node: int = 8

    def __post_init__(self) -> None:
        assert self.ep_mp * self.ep_dp == self.dp, self

    @property
    def world(self) -> int:
        return self.pp * self.dp

    def stage_of(self, dims: Dims, layer: int | None, key: str) -> int:
        if layer is not None:
            return layer * self.pp // dims.layers
        return 0 if key == "model.embed.weight" else self.pp - 1

    def describe(self) -> str:
        return (
            f"{self.world} ranks = PP {self.pp} x {self.dp} per stage; dense Shard(0) over DP {self.dp}; "
            f"experts EP-MP {self.ep_mp} x EP-DP {self.ep_dp} (sharded)"
        )


SAVE = Layout(pp=8, dp=128, ep_mp=64, ep_dp=2)
LOADS = {
    "shrink": Layout(pp=4, dp=128, ep_mp=32, ep_dp=4),  # 512 ranks
    "grow, uneven": Layout(pp=8, dp=192, ep_mp=64, ep_dp=3),  # 1,536 ranks: 5120 / 192 and / 3 do not divide
}

HYPER = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False, "maximize": False}
STEP = 125_000
CONFIG = {
    "model": "moe-166.7b",
    "seq_len": 8192,
    "global_batch_tokens": 16_777_216,
    "lr_schedule": "cosine",
    "warmup_steps": 2000,
    "max_steps": 500_000,
    "grad_clip": 1.0,
    "z_loss": 1e-4,
    "router_aux_loss": 1e-3,
    "precision": "bf16-mixed, fp32 main weights",
    "data_mix": {"web": 0.62, "code": 0.18, "math": 0.08, "books": 0.07, "multilingual": 0.05},
}


# -- one rank's state dict, as the real trainer would hand it to zarrckpt.save --------------------------


@contextlib.contextmanager
def fake_rank(rank: int, world: int) -> Iterator[None]:
    """Pretend to be ``rank`` of ``world``: meshes and DTensors get their real coordinates, no comms."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _meta_dtensor(shape: tuple[int, ...], mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    local, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    empty = torch.empty(local, dtype=torch.float32, device="meta")
    return DTensor.from_local(empty, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def rank_state(dims: Dims, layout: Layout, rank: int) -> dict[str, Any]:
    """The state dict of ``rank`` (inside :func:`fake_rank`): meta DTensors plus real small values."""
    mesh = init_device_mesh("cpu", (layout.pp, layout.dp), mesh_dim_names=("pp", "dp"))
    emesh = init_device_mesh("cpu", (layout.pp, layout.ep_mp, layout.ep_dp), mesh_dim_names=("pp", "ep_mp", "ep_dp"))
    dense, experts = mesh["dp"], emesh["ep_mp", "ep_dp"]
    stage, dp_rank = divmod(rank, layout.dp)
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    for key, shape, group, layer in dims.params():
        if layout.stage_of(dims, layer, key) != stage:
            continue
        place: tuple[DeviceMesh, list[Placement]] = (
            (dense, [Shard(0)]) if group == "dense" else (experts, [Shard(0), Shard(1)])
        )
        weight = _meta_dtensor(shape, *place)  # the moments have the same layout: one meta DTensor serves all three
        model[key[len("model.") :]] = weight
        optim[key] = {
            "exp_avg": weight,
            "exp_avg_sq": weight,
            "step": torch.tensor(float(STEP)),  # torch.optim.Adam: a plain 0-d tensor per parameter
        }
        groups[key] = dict(HYPER)
    rng = torch.Generator().manual_seed(rank).get_state().numpy().tobytes()
    return {
        "model": model,
        "optim": {"state": optim, "param_groups": groups},
        "lr_scheduler": {"last_epoch": STEP, "_step_count": STEP + 1, "base_lrs": [HYPER["lr"]]},
        "trainer": {"step": STEP, "tokens_seen": STEP * CONFIG["global_batch_tokens"], "epoch": 0, "config": CONFIG},
        "dataloader": {f"dp_{dp_rank:04d}": {"epoch": 0, "sample_index": STEP * 16 + dp_rank, "shard": dp_rank % 97}},
        "rng": {f"rank_{rank:04d}": {"cpu": rng, "cuda": bytes(16)}},
    }


def gather_descriptions(dims: Dims, layout: Layout) -> list[bytes]:
    """Every rank's ``collect(state).describe()``, JSON-encoded as ``Group.all_gather_json`` sends it."""
    raws = []
    for rank in range(layout.world):
        with fake_rank(rank, layout.world):
            desc = collect(rank_state(dims, layout, rank)).describe().to_json()
        raws.append(json.dumps(desc, separators=(",", ":"), allow_nan=False).encode())
    return raws


# -- timing helpers ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Medians over repetitions of wall time and of this process's CPU time (CPU time is less
    disturbed by other work on a shared machine)."""

    wall: float
    cpu: float

    def __str__(self) -> str:
        return f"{self.wall:.2f} s ({self.cpu:.2f} s CPU)"


def measure(fn: Callable[[], Any], reps: int) -> tuple[Timing, Any]:
    walls, cpus, result = [], [], None
    for _ in range(reps):
        w, c = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return Timing(statistics.median(walls), statistics.median(cpus)), result


# -- save: what every rank computes, and what it leads to -------------------------------------------------


def plan_of(descriptions: Sequence[RankDescription]) -> ZarrSavePlan:
    """The plan ``zarrckpt.save`` builds from the gathered descriptions (its default chunk and
    small-tensor sizes)."""
    return build_save_plan(descriptions, DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES)


def decode(raws: Sequence[bytes]) -> list[RankDescription]:
    """What every rank does with the gathered buffers (``Group.all_gather_json``, then ``writer.plan_save``)."""
    return [RankDescription.from_json(json.loads(raw)) for raw in raws]


def plan_on_rank(raws: Sequence[bytes], rank: int) -> tuple[ZarrSavePlan, int, int]:
    """Everything a rank computes before writing: decode, plan, its shards and its zarr.json share."""
    plan = plan_of(decode(raws))
    return plan, len(plan.shards_of(rank)), len(plan.metadata_of(rank))


def manifest_of(plan: ZarrSavePlan) -> bytes:
    """The committed root zarr.json (consolidated metadata and the commit record of every chunk's
    crc32c, from what every rank reports it wrote), as rank 0 writes it."""
    written: integrity.Written = {}
    for key, owner in plan.owners.items():
        meta = plan.arrays[key]
        slots = bytes(4 * math.prod(chunks_per_shard(meta.shard_shape, meta.chunk_shape)))  # any values: same size
        written[key] = {integrity.shard_number(meta, idx): slots for idx in owner}
    record = integrity.records(plan.arrays, [integrity.to_json(written)])
    return Manifest(
        "0" * 32, plan.arrays, plan.values, plan.world_size, "2026-01-01T00:00:00+00:00", "zarrckpt", integrity=record
    ).dumps()


def object_nbytes(meta: ArrayMeta, idx: Shape) -> int:
    """Size of a shard object (FORMAT.md section 5): index, then every inner chunk inside the array + crc32c."""
    return ShardLayout.of(meta, idx).nbytes


def puts_for(nbytes: int) -> int:
    """PUT-class requests s3fs sends for one object (multipart from 2 x 50 MiB: create + parts + complete)."""
    if nbytes < 2 * S3_MULTIPART_CHUNK:
        return 1
    return -(-nbytes // S3_MULTIPART_CHUNK) + 2


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


SIZE_BINS = [(4 * 2**10, "< 4 KiB"), (2**20, "4 KiB - 1 MiB"), (16 * 2**20, "1 - 16 MiB"), (math.inf, ">= 16 MiB")]


def save_counts(plan: ZarrSavePlan, manifest: bytes) -> SaveCounts:
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
    for rank in range(world):
        for _, doc in plan.metadata_of(rank):
            per_bytes[rank] += len(doc)
            per_puts[rank] += 1
            doc_bytes += len(doc)
    per_bytes[0] += len(manifest)
    per_puts[0] += 2  # the pending marker, then the manifest (commit)
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
    )


# -- load: a different layout plans its reads from the manifest ----------------------------------------------


def _nowhere(meta: ArrayMeta, box: Box) -> np.ndarray:
    """A destination of the right dtype and shape that takes no memory (planning never touches it)."""
    one = np.empty(1, dtype=storage_dtype(meta.dtype))
    return np.lib.stride_tricks.as_strided(one, shape=box.sizes, strides=(0,) * len(box.sizes))


def load_requests(state: dict[str, Any], manifest: Manifest) -> tuple[list[Request], list[str]]:
    """The read requests ``zarrckpt.load`` makes for ``state`` (one per saved array leaf), and its keys."""
    requests, keys = [], []
    for path, value in iter_leaves(state):
        key = flat_key(path)
        keys.append(key)
        meta = manifest.arrays.get(key)
        if meta is not None:
            requests += [Request(meta, box, _nowhere(meta, box)) for box in target_boxes(meta, value)]
    return requests, sorted(keys)


@dataclass
class LoadCounts:
    layout: Layout
    world: int
    requests: int  # read requests (target regions) over all ranks
    shard_tasks: int
    gets: int  # data GETs over all ranks (the manifest not included)
    bytes_needed: int
    bytes_read: int
    per_rank_bytes: list[int]
    per_rank_gets: list[int]
    gather_bytes: int  # the load path's all-gathered key lists, summed over ranks
    plan_reads: Timing  # per rank: the most CPU-consuming of the first, middle and last rank
    missing_rng: int


def plan_load(dims: Dims, layout: Layout, manifest_raw: bytes, reps: int) -> LoadCounts:
    manifest = Manifest.loads(manifest_raw, "scale model")
    world = layout.world
    per_bytes, per_gets = [0] * world, [0] * world
    requests = tasks = needed = gathered = missing = 0
    slowest = Timing(0.0, 0.0)
    for rank in range(world):
        with fake_rank(rank, world):
            state = rank_state(dims, layout, rank)
        reqs, keys = load_requests(state, manifest)
        missing += sum(1 for k in keys if k.startswith("rng.") and k not in manifest.arrays)
        if rank in (0, world // 2, world - 1):  # timed on a few ranks (every rank plans the same kind of work)
            timing, planned = measure(lambda reqs=reqs: plan_fetches(reqs, OBJECT_STORE), reps)
            slowest = max(slowest, timing, key=lambda t: t.cpu)
        else:
            planned = plan_fetches(reqs, OBJECT_STORE)
        for read in planned:  # what zarrckpt.reader fetches from an object store: one GET per fetch
            per_gets[rank] += len(read.fetches)
            per_bytes[rank] += read.nbytes
        requests += len(reqs)
        tasks += len(planned)
        needed += sum(r.box.volume * r.meta.itemsize for r in reqs)
        gathered += len(json.dumps({"keys": keys, "mismatches": []}, separators=(",", ":")))
    return LoadCounts(
        layout,
        world,
        requests,
        tasks,
        sum(per_gets),
        needed,
        sum(per_bytes),
        per_bytes,
        per_gets,
        gathered,
        slowest,
        missing,
    )


# -- predictions ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Assumptions:
    ranks_per_node: int = 8
    node_bandwidth: float = 10 * GB  # bytes/s per node to (or from) the object store
    latency: float = 0.030  # seconds to first byte of one request
    in_flight: int = 16  # requests in flight per rank (zarrckpt.storecaps.REMOTE_CONCURRENCY)
    put_rate: float = 3500.0  # PUT/s that one S3 prefix partition sustains
    get_rate: float = 5500.0  # GET/s that one S3 prefix partition sustains


@dataclass(frozen=True)
class Transfer:
    bandwidth: float  # the busiest node's bytes / node bandwidth
    latency: float  # the rank with most requests: requests x latency / requests in flight
    one_partition: float  # all requests / the rate of one prefix partition

    @property
    def scaled(self) -> float:
        """The store's request rate does not bind (the prefixes are partitioned)."""
        return max(self.bandwidth, self.latency)

    @property
    def worst(self) -> float:
        """Everything goes through one prefix partition."""
        return max(self.scaled, self.one_partition)


def transfer(per_rank_bytes: Sequence[int], per_rank_requests: Sequence[int], rate: float, a: Assumptions) -> Transfer:
    nodes = range(0, len(per_rank_bytes), a.ranks_per_node)
    busiest = max(sum(per_rank_bytes[n : n + a.ranks_per_node]) for n in nodes)
    return Transfer(
        bandwidth=busiest / a.node_bandwidth,
        latency=max(per_rank_requests) * a.latency / a.in_flight,
        one_partition=sum(per_rank_requests) / rate,
    )


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
                for lay in [lay if isinstance(lay, Layout) else lay.layout]
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
        + f". FSDP-style `Shard(0)` of small tensors over {r.save.dp} ranks makes many tiny objects (a "
        f"{d.d_model:,}-element norm weight becomes {r.save.dp} objects of {4 * d.d_model // r.save.dp} bytes "
        "of data; each 0-d step counter is one object).",
        "",
        "## Loading into a different layout (resharding)",
        "",
        "Each target rank builds its read requests from the manifest (as `zarrckpt.load` does) and plans them "
        "with the real `zarrckpt.fetch.plan_fetches` (object-store capabilities): one GET per planned fetch (the "
        "whole object in one GET when it is <= 8 MiB and all of it is needed, or when it is <= 1 MiB; else its "
        "index plus one ranged GET per run of adjacent needed inner chunks, <= 8 MiB each; with the commit record "
        "in the manifest, as here, no index GET: each chunk is checked against its committed crc32c).",
        "",
        *_table(
            ["", *r.loads],
            [
                ["ranks", *(f"{x.world:,}" for x in r.loads.values())],
                ["read requests (target regions)", *(f"{x.requests:,}" for x in r.loads.values())],
                ["shards touched (tasks)", *(f"{x.shard_tasks:,}" for x in r.loads.values())],
                ["data GET requests", *(f"{x.gets:,}" for x in r.loads.values())],
                ["GETs by the busiest rank", *(f"{max(x.per_rank_gets):,}" for x in r.loads.values())],
                ["bytes needed", *(_gib(x.bytes_needed) for x in r.loads.values())],
                ["bytes read", *(_gib(x.bytes_read) for x in r.loads.values())],
                ["bytes read / bytes needed", *(f"{x.bytes_read / x.bytes_needed:.4f}" for x in r.loads.values())],
                [
                    "manifest GETs per job (rank 0: open, then the end-of-load check; broadcast to the others)",
                    *("2" for _ in r.loads.values()),
                ],
                ["all-gathered key lists (load's `all_gather_json`)", *(_mb(x.gather_bytes) for x in r.loads.values())],
                [
                    "`plan_fetches` on one rank (the slowest of the first, middle and last)",
                    *(str(x.plan_reads) for x in r.loads.values()),
                ],
                [
                    "parse the manifest (`Manifest.loads`), every rank (the end-of-load check reads only the save id)",
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
        "least all requests / partition rate. Checksums, staging copies and the commit barrier are not modelled.",
        "",
        *_prediction_table(r),
        "",
        "## Caveats",
        "",
        "- Planning times are measured on 2 shared CPU cores and taken as medians; a training node's core is "
        "typically faster. The all-gather itself (each rank receives the padded descriptions) is not timed.",
        "- The load-side timings cover planning only (manifest parse, `plan_fetches`); they do not include "
        "building the target state dict or the key comparison `zarrckpt.load` does.",
        "- Object counts follow from the layout: one object per distinct rank box. Small FSDP-sharded tensors "
        "(norms, routers) and per-parameter step counters dominate the count, not the bytes.",
        "- Predictions are first-order (bandwidth, latency, request rate); real object stores add throttling "
        "retries (zarrckpt retries with backoff) and tail latency.",
    ]
    return "\n".join(lines) + "\n"


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
            f"**{r.per_rank.wall + save.scaled:.1f} s**",
            f"**{r.per_rank.wall + save.worst:.1f} s**",
        ]
    ]
    for name, x in r.loads.items():
        # + the manifest on rank 0, read twice (open, then the end-of-load check), broadcast to the others
        gets = [g + (2 if rank == 0 else 0) for rank, g in enumerate(x.per_rank_gets)]
        nbytes = [b + (2 * c.manifest_bytes if rank == 0 else 0) for rank, b in enumerate(x.per_rank_bytes)]
        load = transfer(nbytes, gets, a.get_rate, a)
        plan = 2 * r.manifest_parse.wall + x.plan_reads.wall
        rows.append(
            [
                f"load: {name} ({x.world:,} ranks)",
                f"{plan:.1f} s",
                f"{load.bandwidth:.1f} s",
                f"{load.latency:.1f} s",
                f"{load.one_partition:.1f} s",
                f"**{plan + load.scaled:.1f} s**",
                f"**{plan + load.worst:.1f} s**",
            ]
        )
    return _table(
        [
            "",
            "planning (measured)",
            "bandwidth",
            "latency",
            "request rate, one partition",
            "total, scaled",
            "total, one partition",
        ],
        rows,
    )


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
        loads={name: plan_load(dims, lay, manifest, reps) for name, lay in loads.items()},
        assumptions=Assumptions(ranks_per_node=save.ranks_per_node),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each timed step (medians are reported)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "scale.md")
    parser.add_argument(
        "--profile", type=Path, default=None, help="write a cProfile of the coordinator's planning here"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = run(Dims(), SAVE, LOADS, args.reps, args.profile)
    text = render(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
