"""N local processes joined by a gloo process group (tests, benchmarks, the demo), and free ports.

``spawn(world, fn, *args)`` calls ``fn(rank, world, *args)`` in each process and raises
``torch.multiprocessing.ProcessRaisedException`` (with the rank's traceback) if any of them
fails. For real jobs use ``torchrun``; this is for single-machine runs on the CPU.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from zarrckpt.example import launch


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` processes; raise if any of them fails.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function).
    """
    # a file:// rendezvous, as the example's launcher: a port found free, then bound by the group's
    # store a moment later, was taken meanwhile (EADDRINUSE, in a CI run with servers starting beside)
    launch.spawn(world, fn, *args, timeout_s=timeout_s)
