"""Demo: save a sharded training state from 4 ranks, load it into 3 ranks, check it bit for bit.

    python -m zarrckpt.demo [--url DIR_OR_URL] [--save-world 4] [--load-world 3]

Runs real processes joined by a gloo process group on the CPU. Without ``--url`` the
checkpoint goes to a fresh local directory under ./demo-checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import zarrckpt

# a tiny transformer-with-experts: key -> (global shape, placement over the 1-D mesh)
LAYOUT: dict[str, tuple[tuple[int, ...], Any]] = {
    "embed.weight": ((1000, 64), Shard(0)),
    **{f"layers.{i}.attn.wqkv": ((64, 192), Shard(1)) for i in range(2)},
    **{f"layers.{i}.moe.experts.w1": ((8, 64, 128), Shard(0)) for i in range(2)},
    **{f"layers.{i}.norm.weight": ((64,), Replicate()) for i in range(2)},
}


def _global(key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(LAYOUT[key.split(".", 2)[-1] if key.startswith("optim") else key][0], generator=g)


def _state(world: int, fill: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    model, moments = {}, {}
    for key, (shape, placement) in LAYOUT.items():
        full = _global(key) if fill else torch.zeros(shape)
        model[key] = DTensor.from_local(full, mesh, [Replicate()], run_check=False).redistribute(mesh, [placement])
        exp_avg = torch.zeros(shape) if fill else torch.full(shape, 9.0)
        moments[key] = {
            "exp_avg": DTensor.from_local(exp_avg, mesh, [Replicate()], run_check=False).redistribute(
                mesh, [placement]
            ),
            "step": torch.tensor(100.0 if fill else 0.0),
        }
    return {
        "model": model,
        "optim": {"state": moments, "param_groups": [{"lr": 3e-4 if fill else 0.0, "betas": [0.9, 0.95]}]},
        "trainer": {"step": 100 if fill else 0, "tokens": 409_600 if fill else 0},
        "rng": torch.Generator().manual_seed(1).get_state() if fill else torch.zeros(5056, dtype=torch.uint8),
    }


def _run(rank: int, world: int, port: int, job: str, url: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        state = _state(world, fill=job == "save")
        dist.barrier()
        start = time.perf_counter()
        if job == "save":
            zarrckpt.save(state, url, overwrite=True)
        else:
            zarrckpt.load(state, url)
        elapsed = time.perf_counter() - start
        diff = 0.0
        if job == "load":
            for key, value in state["model"].items():
                diff = max(diff, (value.full_tensor() - _global(key)).abs().max().item())
            assert state["trainer"]["step"] == 100
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"seconds": elapsed, "max_abs_diff": diff}, f)
        dist.barrier()  # gloo aborts a rank that tears down while a peer still talks to it
    finally:
        dist.destroy_process_group()


def _spawn(world: int, job: str, url: str) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.spawn(_run, args=(world, port, job, url, out.name), nprocs=world, join=True)
        with open(out.name) as f:
            result: dict[str, float] = json.load(f)
            return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="checkpoint location (directory, file://, memory:// is per-process: avoid)")
    parser.add_argument("--save-world", type=int, default=4)
    parser.add_argument("--load-world", type=int, default=3)
    args = parser.parse_args(argv)
    url = args.url or os.path.join("demo-checkpoints", time.strftime("run-%Y%m%d-%H%M%S"))

    print(f"saving from {args.save_world} ranks to {url} ...")
    saved = _spawn(args.save_world, "save", url)
    from .commit import read_manifest
    from .storage import Storage

    manifest = read_manifest(Storage(url))
    print(f"\n{'tensor':<44} {'role':<15} {'shape':<15} {'dtype':<8} {'shard':<14} {'chunk':<14}")
    for key, meta in sorted(manifest.arrays.items()):
        print(
            f"{key:<44} {meta.role:<15} {list(meta.shape)!s:<15} {meta.dtype:<8} "
            f"{list(meta.shard_shape)!s:<14} {list(meta.chunk_shape)!s:<14}"
        )
    total = sum(m.nbytes for m in manifest.arrays.values())
    print(f"\nplain values: {json.dumps(manifest.values)[:120]}")
    print(f"\nloading into {args.load_world} ranks (a different sharding of every tensor) ...")
    loaded = _spawn(args.load_world, "load", url)
    print(f"\n{'step':<34} {'ranks':>5} {'tensors':>8} {'MB':>8} {'seconds':>8}")
    print(f"{'save':<34} {args.save_world:>5} {len(manifest.arrays):>8} {total / 1e6:>8.2f} {saved['seconds']:>8.3f}")
    print(
        f"{'load (resharded)':<34} {args.load_world:>5} {len(manifest.arrays):>8} {total / 1e6:>8.2f} "
        f"{loaded['seconds']:>8.3f}"
    )
    print(f"\nmax |restored - saved| over model tensors: {loaded['max_abs_diff']}")
    return 0 if loaded["max_abs_diff"] == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
