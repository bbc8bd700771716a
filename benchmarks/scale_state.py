"""The scale model's subject: a 166.7B-parameter MoE (:class:`Dims`), its parallel layouts
(:class:`Layout`), one simulated rank's state dict as the trainer hands it to ``zarrckpt.save``
(meta DTensors under a fake process group: :func:`fake_rank`, :func:`rank_state`), and the timing
helpers of the scale model (``scale_model.py``, ``scale_compact.py``)."""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
import zarrckpt
from zarrckpt.plan.localstate import collect

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
    stage = rank // layout.dp
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
    return {
        "model": model,
        "optim": {"state": optim, "param_groups": groups},
        "lr_scheduler": {"last_epoch": STEP, "_step_count": STEP + 1, "base_lrs": [HYPER["lr"]]},
        "trainer": {"step": STEP, "tokens_seen": STEP * CONFIG["global_batch_tokens"], "epoch": 0, "config": CONFIG},
        **per_rank_state(layout, rank),
    }


def per_rank_keys_state(layout: Layout, rank: int) -> dict[str, Any]:
    """The same state under a key per rank (RNG) and per DP rank (data loader), as the scale model held it
    before issue 40: ``tests/plan_cases.py`` records the planner's plans of it."""
    dp_rank = rank % layout.dp
    rng = torch.Generator().manual_seed(rank).get_state().numpy().tobytes()
    return {
        "dataloader": {f"dp_{dp_rank:04d}": {"epoch": 0, "sample_index": STEP * 16 + dp_rank, "shard": dp_rank % 97}},
        "rng": {f"rank_{rank:04d}": {"cpu": rng, "cuda": bytes(16)}},
    }


def per_rank_state(layout: Layout, rank: int) -> dict[str, Any]:
    """The state that differs by rank: RNG states and the data-loader position, as ``zarrckpt.PerRank``
    arrays (one array per key, a row per rank; issue 40), not as keys per rank."""
    dp_rank = rank % layout.dp
    rng = torch.Generator().manual_seed(rank).get_state()
    position = [0, STEP * 16 + dp_rank, dp_rank % 97]  # epoch, sample index, shard
    return {
        "dataloader": zarrckpt.PerRank(torch.tensor(position, dtype=torch.int64)),
        "rng": {"cpu": zarrckpt.PerRank(rng), "cuda": zarrckpt.PerRank(torch.zeros(16, dtype=torch.uint8))},
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
