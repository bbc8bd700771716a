"""N local processes joined by a gloo process group (tests, benchmarks, the demo), and free ports.

``spawn(world, fn, *args)`` calls ``fn(rank, world, *args)`` in each process and raises
``torch.multiprocessing.ProcessRaisedException`` (with the rank's traceback) if any of them
fails. For real jobs use ``torchrun``; this is for single-machine runs on the CPU.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn as mp_spawn


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, timeout_s: float, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        fn(rank, world, *args)
        dist.barrier()  # gloo aborts a rank that tears down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    # Success. Skip interpreter finalization: gloo's C++ threads can still hold objects whose
    # destructors need the interpreter, and a process ending normally then dies of SIGABRT
    # ("terminate called without an active exception") after all its work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` processes; raise if any of them fails.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function).
    """
    mp_spawn(_entry, args=(world, free_port(), timeout_s, fn, args), nprocs=world, join=True)
