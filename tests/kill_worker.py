"""One rank of a save that the kill test interrupts: python kill_worker.py RANK WORLD PORT ROOT STEP."""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import zarrckpt

ROWS, COLS, TENSORS = 2048, 1024, 8  # 64 MiB of float32, 32 MiB per rank


def global_tensor(step: int, i: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(1000 * step + i))


def state(rank: int, world: int, step: int) -> dict:
    rows = ROWS // world
    return {
        "model": {
            f"w{i}": zarrckpt.LocalShard(
                global_tensor(step, i)[rank * rows : (rank + 1) * rows].clone(), (ROWS, COLS), (rank * rows, 0)
            )
            for i in range(TENSORS)
        },
        "step": step,
    }


def main() -> None:
    rank, world, port, root, step = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    sd = state(rank, world, step)
    manager = zarrckpt.CheckpointManager(root, interval=1, keep_last=10, async_save=False)
    dist.barrier()
    print("SAVING", time.monotonic(), flush=True)
    manager.save(step, sd)
    print("DONE", time.monotonic(), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
