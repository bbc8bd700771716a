"""Host staging buffers for :mod:`zarrckpt.staging` (``async_save``, and ``save`` from GPU): a copy
of each tensor the training loop can no longer change (pinned for GPU tensors), from buffers kept
between saves (no fresh allocation and page faults each time)."""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["pool", "recycle", "release_staging", "to_host"]


class _HostPool:
    """Host staging buffers kept for the next async_save (no fresh allocation and page faults each time),
    by (shape, dtype, pinned); holds at most what one save had staged at once."""

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.nbytes = 0  # held in the pool

    def __len__(self) -> int:
        return sum(map(len, self._free.values()))

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor | None:
        with self._lock:
            free = self._free.get((shape, dtype, pinned))
            if not free:
                return None
            self.nbytes -= free[-1].nbytes
            return free.pop()

    def give(self, t: torch.Tensor, keep_bytes: int | None = None) -> None:
        """Keep ``t`` for a later copy (``keep_bytes``: only while the pool holds at most that)."""
        with self._lock:
            if keep_bytes is not None and self.nbytes + t.nbytes > keep_bytes:
                return  # dropped: freed (pinned memory: back to torch's own cache)
            self._free.setdefault((tuple(t.shape), t.dtype, t.is_pinned()), []).append(t)
            self.nbytes += t.nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.nbytes = 0


pool = _HostPool()


def release_staging() -> None:
    """Free the host staging buffers async_save keeps between saves."""
    pool.clear()


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy the training loop can no longer change (pinned for GPU tensors)."""
    t = t.detach()
    gpu = t.device.type != "cpu"
    host = pool.take(tuple(t.shape), t.dtype, gpu)
    if host is None:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=gpu)
    host.copy_(t, non_blocking=gpu)
    if gpu:
        torch.cuda.current_stream(t.device).synchronize()
    return host


def recycle(t: torch.Tensor, keep_bytes: int | None = None) -> None:
    """Give a staged copy back to the pool (``keep_bytes``: only while the pool holds at most that)."""
    pool.give(t, keep_bytes)
