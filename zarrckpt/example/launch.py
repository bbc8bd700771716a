"""Process groups for the example without the test harness: one process alone, or N local processes.

:func:`init_alone` joins a process group of one whose store listens on a port the system picks
(``tcp://127.0.0.1:0``: nobody else needs to know it).
:func:`spawn` runs ``fn(rank, world, *args)`` on ``world`` local processes joined by a gloo group
whose rendezvous is a file in a fresh temporary directory (no port to pick, so none to race
for). For real jobs use ``torchrun`` (``python -m zarrckpt.example.train`` joins its env://
rendezvous).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn as mp_spawn


def init_alone(backend: str) -> None:
    """Join a process group of this process alone (rank 0 of 1)."""
    dist.init_process_group(backend, init_method="tcp://127.0.0.1:0", rank=0, world_size=1)


def spawn(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` local processes joined by a gloo group; raise
    ``torch.multiprocessing.ProcessRaisedException`` (with the rank's traceback) if any fails.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function).
    """
    with tempfile.TemporaryDirectory(prefix="zarrckpt-example-") as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp_spawn(run_rank, args=(world, init, timeout_s, fn, args), nprocs=world, join=True)


def run_rank(rank: int, world: int, init: str, timeout_s: float, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """One spawned rank: join the gloo group at ``init``, run ``fn(rank, world, *args)``, leave cleanly."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
        dist.barrier()  # gloo aborts a rank that tears down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    # Success. Skip interpreter finalization: gloo's C++ threads can still hold objects whose
    # destructors need the interpreter, and a process ending normally can then die of SIGABRT
    # after all its work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
