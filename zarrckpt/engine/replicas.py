"""The save-time replica check: ranks holding the same block of a tensor must hold the same bytes.

A replicated block is written once, by one rank; if the replicas differ (a desynchronised DDP
replica, per-rank state under a shared key) the others' values would be lost silently. So every
holder of a replicated block sends a crc32c digest of all its bytes, and a difference fails the
save on every rank before anything is written. Only keys the plan found replicated are digested,
so a fully sharded state pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import crc32c
import numpy as np

from zarrckpt.engine.dist import Group
from zarrckpt.errors import SaveLayoutError
from zarrckpt.format import dtypes
from zarrckpt.plan.localstate import LocalState
from zarrckpt.plan.save import ZarrSavePlan


def digests(plan: ZarrSavePlan, local: LocalState) -> dict[str, list[list[Any]]]:
    """This rank's ``key -> [[block offsets, crc32c of all its bytes], ...]`` (one per part) for
    the replicated keys it holds."""
    out: dict[str, list[list[Any]]] = {}
    for key in sorted(plan.replicated):
        for part in local.tensors.get(key, ()):
            data = np.ascontiguousarray(dtypes.as_numpy(part.data.detach().cpu()))
            out.setdefault(key, []).append(
                [list(part.box.offsets), crc32c.crc32c(data.reshape(-1).view(np.uint8).data)]
            )
    return out


def differences(views: Sequence[dict[str, list[list[Any]]]]) -> list[str]:
    """Replicated blocks whose holders (``views[rank]`` from :func:`digests`) hold different bytes."""
    held: dict[tuple[str, tuple[int, ...]], dict[int, list[int]]] = {}
    for rank, view in enumerate(views):
        for key, blocks in view.items():
            for offsets, digest in blocks:
                held.setdefault((key, tuple(offsets)), {}).setdefault(digest, []).append(rank)
    problems = []
    for (key, offsets), by_digest in sorted(held.items()):
        if len(by_digest) > 1:
            who = "; ".join(f"ranks {ranks}: crc32c {d:08x}" for d, ranks in sorted(by_digest.items()))
            where = f" (block at {list(offsets)})" if any(offsets) else ""
            problems.append(f"{key}{where}: replicas with different contents ({who})")
    return problems


def check(group: Group, plan: ZarrSavePlan, local: LocalState) -> None:
    """Raise SaveLayoutError on every rank when the replicas of some block differ (one collective, if any)."""
    if plan.replicated and group.active:
        report(group, plan, local)


def report(group: Group, plan: ZarrSavePlan, local: LocalState) -> None:
    """:func:`check` on every rank, whatever its plan holds (collective)."""
    problems = differences(group.all_gather_json(digests(plan, local)))
    if problems:
        raise SaveLayoutError(
            "nothing was written: ranks that hold the same block of a tensor hold different values, and only one "
            "copy would be saved:\n  " + "\n  ".join(problems[:50]) + "\nGive per-rank state per-rank keys (or a "
            "DTensor); check_replicas=False skips this check."
        )
