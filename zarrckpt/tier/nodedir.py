"""A node's tier directory on disk: its local steps, their markers, pruning and room.

Layout (docs/FORMAT.md §8)::

    <tier root>/step_<10-digit step>.<save id>/        a local step: zarrckpt's own format
        zarr.json, .zarrckpt-crc32c                    its manifest and checksum table (every node)
        <array>/c.<i>...                               the shards this node's ranks wrote, and copies
        .zarrckpt-tier/held-<rank>.json                this directory holds every object of that rank
        .zarrckpt-tier/committed.json                  every copy existed when the save ended
    <tier root>/.restore-<save id>.<node>/            an older zarrckpt's restore left (the next save deletes it)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Collection, Sequence
from typing import Any

from zarrckpt.errors import TierSpaceError, ZarrckptError
from zarrckpt.format.manifest import MANIFEST
from zarrckpt.tier.layout import COMMITTED, RESTORING, STEP_DIR, TIER_DIR, StepSeen, held_marker, step_dir

log = logging.getLogger("zarrckpt")


def scan(root: str) -> list[StepSeen]:
    """The local steps in ``root`` that have a manifest, with what their markers say (markers of
    another save than the directory's are ignored); newest first (of two saves of a step, the later)."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        m = STEP_DIR.match(name)
        if m is None or not os.path.exists(os.path.join(root, name, MANIFEST)):
            continue
        step, sid = int(m.group(1)), m.group(2)
        held, world, started, committed = [], None, 0.0, False
        for doc in _markers(os.path.join(root, name, TIER_DIR)):
            if doc.get("save_id") != sid:
                continue
            world, started = int(doc["world_size"]), float(doc["started"])
            if doc.get("kind") == "committed":
                committed = True
            elif doc.get("kind") == "held":
                held.append(int(doc["rank"]))
        if world is not None:
            out.append(StepSeen(step, sid, world, committed, tuple(sorted(held)), started))
    return sorted(out, key=lambda s: (s.step, s.started), reverse=True)


def _markers(where: str) -> list[dict[str, Any]]:
    docs = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(where):
            if name.endswith(".json"):
                try:
                    with open(os.path.join(where, name), "rb") as f:
                        docs.append(json.loads(f.read()))
                except (OSError, ValueError):  # a marker torn by a crash: as if absent
                    continue
    return docs


def write_marker(step_root: str, path: str, doc: dict[str, Any]) -> None:
    """Write a marker durably: a temporary name, fsync, rename, then the directory flushed."""
    full = os.path.join(step_root, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    tmp = f"{full}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(json.dumps(doc).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, full)
    fd = os.open(os.path.dirname(full), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def held(step_root: str, rank: int, doc: dict[str, Any]) -> None:
    write_marker(step_root, held_marker(rank), {**doc, "kind": "held", "rank": rank})


def committed(step_root: str, doc: dict[str, Any]) -> None:
    write_marker(step_root, COMMITTED, {**doc, "kind": "committed"})


def doomed(root: str, keep: int, committed_elsewhere: Collection[str] = ()) -> list[str]:
    """What :func:`prune` deletes: every step directory but the ``keep`` newest committed ones, and
    any restore's scratch directory an older zarrckpt left. A step counts as committed when this node
    or another saw it so (``committed_elsewhere``: save ids): a kill between two nodes' committed markers
    leaves a whole copy without its own."""
    committed = [s for s in scan(root) if s.committed or s.save_id in committed_elsewhere]
    kept = {step_dir(s.step, s.save_id) for s in committed[: max(keep, 0)]}
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return [n for n in names if (STEP_DIR.match(n) and n not in kept) or n.startswith(RESTORING)]


def prune(root: str, keep: int, committed_elsewhere: Collection[str] = ()) -> list[str]:
    """Before a new local step: delete :func:`doomed`'s directories; returns their names."""
    gone = doomed(root, keep, committed_elsewhere)
    for name in gone:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return gone


def check_room(root: str, need: int, reclaimable: int, tier: Any, nodes: Sequence[str]) -> None:
    """Raise ``TierSpaceError`` when ``root``'s filesystem has less than ``need`` bytes free, counting
    ``reclaimable`` bytes of it (steps that will be deleted) as free."""
    os.makedirs(root, exist_ok=True)
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize + reclaimable
    if free < need:
        raise TierSpaceError(
            f"the local tier at {root} has room for {free / 2**20:.1f} MiB, and needs {need / 2**20:.1f} MiB "
            f"(keep={tier.keep} steps of this node's shards and the copies it holds for replicas={tier.replicas} "
            f"other nodes; the job's nodes: {', '.join(nodes)}): give it more room (a bigger /dev/shm, another "
            "path), or lower keep or replicas; nothing of this step was written"
        )


def usage(root: str, names: Sequence[str]) -> int:
    """The bytes of the files under ``root``'s directories ``names``."""
    total = 0
    for name in names:
        for where, _, files in os.walk(os.path.join(root, name)):
            for file in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(where, file)).st_size
    return total


def read_into(step_root: str, path: str, view: memoryview, offset: int = 0) -> None:
    """Fill ``view`` from byte ``offset`` of the object ``path``."""
    with open(os.path.join(step_root, path), "rb") as f:
        f.seek(offset)
        if f.readinto(view) != len(view):
            raise ZarrckptError(f"{os.path.join(step_root, path)}: shorter than it was a moment ago")


def size(step_root: str, path: str) -> int:
    return os.path.getsize(os.path.join(step_root, path))


def now() -> float:
    return time.time()
