"""The floor of a restore after a node loss on this machine: the bytes alone, as ``tier.py`` measures
it beside the two restores.

Every rank fills its local shards (the same tensors the restores fill) and computes their crc32c. A
rank of a surviving node reads its bytes from one file in the tier's memory (``/dev/shm``), with
vectored reads straight into the tensors. A rank of the lost node gets its bytes over gloo, from the
rank with the same local index on the next node, which reads them from that rank's file. Nothing
else: no choice of a step, no manifest, no planning, no collective but the transfers. No restore
can be faster than this on the same machine, so ``S3 restore / floor`` is the largest speed-up any
local restore could show here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import crc32c
import numpy as np
import torch
import torch.distributed as dist

IOV_MAX = 512


def _views(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    return [t.reshape(-1).view(torch.uint8).numpy() for t in tensors]


def write_files(tensors: list[torch.Tensor], root: Path, rank: int) -> None:
    """This rank's bytes (its local shards, as generated) in ``root/<rank>``, their sizes beside."""
    root.mkdir(parents=True, exist_ok=True)
    views = _views(tensors)
    with open(root / str(rank), "wb") as f:
        for v in views:
            f.write(v)
    (root / f"{rank}.json").write_text(json.dumps([int(v.nbytes) for v in views]))


class Floor:
    """One rank's part of the floor; ``lost``: the ranks of the lost node (their bytes travel over gloo)."""

    def __init__(self, tensors: list[torch.Tensor], root: Path, rank: int, world: int, per_node: int, lost: set[int]):
        self.views = _views(tensors)
        self.root = root
        self.source = (rank + per_node) % world if rank in lost else None  # who sends this rank its bytes
        peer = (rank - per_node) % world
        self.ships_for = peer if peer in lost and rank not in lost else None  # whose bytes this rank sends
        self.sizes: list[int] = []
        self.buffer = np.empty(0, dtype=np.uint8)
        if self.ships_for is not None:
            self.sizes = json.loads((root / f"{self.ships_for}.json").read_text())
            self.buffer = np.empty(max(self.sizes, default=0), dtype=np.uint8)  # one, reused (a pooled buffer)
        self.path = root / str(rank)

    def __call__(self) -> None:
        if self.ships_for is not None:
            self._ship()
        if self.source is not None:
            for v in self.views:
                dist.recv(torch.from_numpy(v), src=self.source)
        else:
            self._read(self.path, self.views)
        for v in self.views:
            crc32c.crc32c(v)

    def _ship(self) -> None:
        fd = os.open(self.root / str(self.ships_for), os.O_RDONLY)
        try:
            at = 0
            for n in self.sizes:
                view = self.buffer[:n]
                got = os.preadv(fd, [view], at)
                if got != n:
                    raise OSError(f"floor: short read of rank {self.ships_for}'s bytes")
                at += n
                dist.send(torch.from_numpy(view), dst=self.ships_for)
        finally:
            os.close(fd)

    @staticmethod
    def _read(path: Path, views: list[np.ndarray]) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            at = 0
            for i in range(0, len(views), IOV_MAX):
                batch = views[i : i + IOV_MAX]
                want = sum(v.nbytes for v in batch)
                if os.preadv(fd, batch, at) != want:
                    raise OSError(f"floor: short read of {path}")
                at += want
        finally:
            os.close(fd)
