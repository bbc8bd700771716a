"""N local processes joined by a gloo process group (tests, benchmarks, the demo), and free ports.

``spawn(world, fn, *args)`` calls ``fn(rank, world, *args)`` in each process and raises
``torch.multiprocessing.ProcessRaisedException`` (with the rank's traceback) if any of them
fails. For real jobs use ``torchrun``; this is for single-machine runs on the CPU.

The processes are forked from multiprocessing's *forkserver*, which imported torch once (per
calling process): a rank starts in a fraction of a second instead of importing torch afresh
(~1.4 s of CPU on a 2-core machine, hundreds of times in the test suite). Each gets the caller's
environment as it is at the call (a forkserver's children would otherwise inherit the server's,
from when it started), its ``sys.path`` and working directory.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

from torch.multiprocessing.spawn import start_processes

from zarrckpt.example import launch

PRELOAD = ["torch", "torch.distributed", "numpy"]  # what the forkserver imports before it forks a rank


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0, fresh: bool = False) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` processes; raise if any of them fails.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). ``fresh``: each rank a
    new interpreter (multiprocessing's *spawn*), as the benchmarks take them: nothing shared with a
    server process, nothing imported before the rank's own code, as under ``torchrun``.
    """
    # a file:// rendezvous, as the example's launcher: a port found free, then bound by the group's
    # store a moment later, was taken meanwhile (EADDRINUSE, in a CI run with servers starting beside)
    if fresh:
        launch.spawn(world, fn, *args, timeout_s=timeout_s)
        return
    multiprocessing.set_forkserver_preload(PRELOAD)  # (read when this process's server starts)
    with tempfile.TemporaryDirectory(prefix="zarrckpt-spawn-") as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        env = dict(os.environ)
        start_processes(_rank, (env, world, init, timeout_s, fn, args), nprocs=world, start_method="forkserver")


def _rank(
    rank: int, env: dict[str, str], world: int, init: str, timeout_s: float, fn: Callable[..., Any], args: Any
) -> None:
    """One rank: the caller's environment, then :func:`zarrckpt.example.launch.run_rank`."""
    os.environ.clear()
    os.environ.update(env)
    launch.run_rank(rank, world, init, timeout_s, fn, args)
