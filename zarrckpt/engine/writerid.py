"""Who wrote a marker (:mod:`zarrckpt.engine.markers`), and whether that writer still runs: this
process's identity as a marker names it (host and pid, and where the system tells them, the boot id,
PID namespace and the pid's start time that make the pid mean something), and what /proc says of a
writer that ran under this very kernel and PID namespace.
"""

from __future__ import annotations

import os
import socket
from functools import cache
from typing import Any


def writer_identity() -> dict[str, Any]:
    """This process as a marker names it: host and pid, and (Linux) the boot id, PID namespace and
    the pid's start time, without which another reader cannot tell whether the pid is this process."""
    return dict(_identity(os.getpid()))


@cache
def _identity(pid: int) -> tuple[tuple[str, Any], ...]:
    return tuple({"host": socket.gethostname(), "pid": pid, **_kernel(), **_started(pid)}.items())


@cache
def _kernel() -> dict[str, str]:
    """This kernel's boot id and this process's PID namespace ({} where the system does not say)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return {}
    return {"boot": boot, "pidns": pidns} if boot and pidns else {}


def _started(pid: int) -> dict[str, int]:
    stat = proc_stat(pid)
    return {} if stat is None else {"start": stat[1]}


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of process ``pid`` in this PID namespace; None
    when there is no such process (or no /proc to ask)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def here(writer: dict[str, Any]) -> bool:
    """Whether ``writer`` ran under this kernel and PID namespace, so that its pid names a process here.
    A shared hostname proves nothing (containers, pods of one job); the boot id and namespace do."""
    mine = writer_identity()
    return bool(mine.get("boot")) and all(writer.get(k) == mine[k] for k in ("boot", "pidns"))


def gone_here(writer: dict[str, Any]) -> str | None:
    """Why ``writer`` (a marker's) no longer runs, when it provably ran here; None: it may run."""
    pid, start = writer.get("pid"), writer.get("start")
    if not isinstance(pid, int) or not here(writer):
        return None
    stat = proc_stat(pid)
    if stat is None:
        return f"its writer, process {pid} on this host, is gone"
    if stat[0] in ("Z", "X"):
        return f"its writer, process {pid} on this host, has exited"
    if isinstance(start, int) and stat[1] != start:
        return f"its writer, process {pid} on this host, is gone (another process has its pid now)"
    return None


def is_me(writer: dict[str, Any]) -> bool:
    mine = writer_identity()
    return all(writer.get(k) == mine.get(k) for k in ("host", "pid", "boot", "pidns", "start"))
