"""Deterministic state dicts for round-trip tests, built for any world size / mesh.

Every global tensor is a pure function of its key, so a rank of any topology can build the
exact local part it should hold (``expected``) or an all-garbage target to load into.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

SPECS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "model.embed.weight": ((10, 6), torch.float32),  # uneven: 10 rows over 4 / 3 ranks
    "model.layers.0.attn.wqkv": ((8, 12), torch.float32),
    "model.layers.0.mlp.w1": ((16, 4), torch.bfloat16),
    "model.layers.0.norm.weight": ((6,), torch.float32),
    "optim.state.model.embed.weight.exp_avg": ((10, 6), torch.float32),
    "optim.state.model.embed.weight.exp_avg_sq": ((10, 6), torch.float32),
    "model.layers.0.mlp.b1": ((3, 5), torch.float16),
    "model.layers.0.mlp.idx": ((7,), torch.int64),
    "model.layers.0.mlp.mask": ((4, 4), torch.bool),
    "model.layers.0.mlp.q8": ((4, 8), torch.float8_e4m3fn),
}
ZERO_KEYS = {"optim.state.model.embed.weight.exp_avg", "optim.state.model.embed.weight.exp_avg_sq"}


def global_tensor(key: str) -> torch.Tensor:
    shape, dtype = SPECS[key]
    if key in ZERO_KEYS:
        return torch.zeros(shape, dtype=dtype)
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def shard(key: str, mesh: Any, placements: list[Placement], fill: bool) -> DTensor:
    full = global_tensor(key)
    local_shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape, strict=True))
    local = full[index].clone() if fill else torch.full(local_shape, 7, dtype=full.dtype)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{'a.b': x} -> {'a': {'b': x}} (the way state_dict() / get_state_dict() nest)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        top, rest = key.split(".", 1) if key.startswith(("model.", "optim.")) else (key, None)
        if rest is None:
            out[top] = value
        elif top == "optim":
            param, leaf = rest[len("state.") :].rsplit(".", 1)
            out.setdefault("optim", {"state": {}, "param_groups": [{"lr": 0.001, "betas": [0.9, 0.95]}]})
            out["optim"]["state"].setdefault(param, {})[leaf] = value
        else:
            out.setdefault("model", {})[rest] = value
    return out


def mixed_state(rank: int, world: int, fill: bool, save_world: int = 4) -> dict[str, Any]:
    """DTensors sharded various ways over a 1-D mesh, replicated plain tensors, values, RNG state."""
    mesh = init_device_mesh("cpu", (world,))
    plac: dict[str, list[Placement]] = {
        "model.layers.0.attn.wqkv": [Shard(1)],
        "model.layers.0.norm.weight": [Replicate()],
    }
    flat: dict[str, Any] = {}
    for key in SPECS:
        if key == "model.layers.0.mlp.b1":  # a plain tensor every rank holds (replicated)
            flat[key] = global_tensor(key).clone() if fill else torch.zeros(3, 5, dtype=torch.float16)
        else:
            flat[key] = shard(key, mesh, plac.get(key, [Shard(0)]), fill)
    state = nest(flat)
    # pipeline-style: a stage's tensors live only on the ranks of that stage
    for stage in range(2):
        if rank % 2 == stage or world == 1:
            state.setdefault("model", {})[f"stage{stage}.w"] = (
                torch.full((4, 3), float(stage + 1)) if fill else torch.zeros(4, 3)
            )
    random.seed(1234)
    state["step"] = 1000 if fill else 0
    state["config"] = {"name": "tiny-moe", "layers": [1, 2, 3], "lr": 3e-4, "flags": {"fused": True}} if fill else {}
    state["rng"] = {
        "torch": torch.Generator().manual_seed(7).get_state() if fill else torch.zeros(5056, dtype=torch.uint8),
        "python": random.getstate() if fill else random.Random(0).getstate(),
    }
    # per-rank state under per-rank keys; a loading rank takes the saved ranks r with r % world == rank
    for r in range(save_world):
        if r % world == rank:
            state[f"rank{r}"] = {"seed": r * 11 if fill else -1, "blob": bytes([r] * 5) if fill else b""}
    return state


def check_loaded(state: dict[str, Any], rank: int, world: int, save_world: int = 4) -> None:
    expected = mixed_state(rank, world, fill=True, save_world=save_world)
    _assert_same(state, expected, "")


def _assert_same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, DTensor):
        assert isinstance(got, DTensor), where
        a, b = got.to_local(), want.to_local()
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{where}: local shards differ"
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), where
    else:
        assert got == want and type(got) is type(want), f"{where}: {got!r:.200} != {want!r:.200}"
