"""What one :class:`~zarrckpt.storage.store.Storage` asked of its store: requests and bytes, counted as
they happen (thread-safe), for ``Checkpoint.stats()`` and for anyone tuning reads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Traffic"]


@dataclass
class Traffic:
    """Counters of one Storage: every attempt of a request counts (a retried request counts twice,
    and once in ``retries``); a listing counts as one request however many pages it took."""

    requests: int = 0
    retries: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    watch: Callable[[int], None] | None = None  # called with each read's or write's byte count (progress)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, requests: int = 0, retries: int = 0, bytes_read: int = 0, bytes_written: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.retries += retries
            self.bytes_read += bytes_read
            self.bytes_written += bytes_written
        if self.watch is not None and (bytes_read or bytes_written):
            self.watch(bytes_read + bytes_written)

    def snapshot(self) -> dict[str, int]:
        """``{"requests", "retries", "bytes_read", "bytes_written"}`` so far."""
        with self._lock:
            return {
                "requests": self.requests,
                "retries": self.retries,
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
            }
