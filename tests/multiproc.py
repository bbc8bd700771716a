"""Run a function on N real processes joined by a gloo process group (torch.multiprocessing spawn)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` processes; raises if any of them fails."""
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)
