"""Bounded concurrency over a stream of items (the storage layer's reads and writes)."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class _Ran(Generic[R]):
    """An item run on the calling thread: its result or failure, in the line of the threads' futures
    (a Future each cost more than a small local write)."""

    __slots__ = ("error", "value")

    def __init__(self, value: R | None, error: Exception | None = None) -> None:
        self.value, self.error = value, error

    def result(self) -> R:
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]

    def cancel(self) -> bool:
        return False


def run_bounded(fn: Callable[[T], R], items: Iterable[T], limit: int, inline: Callable[[T], bool] | None) -> list[R]:
    """Run ``fn`` over ``items``, at most ``limit`` at a time; results in order; re-raise the first
    failure (see :meth:`zarrckpt.storage.store.Storage.run_all`)."""
    it = iter(items)
    head = list(itertools.islice(it, 2))
    if limit <= 1 or len(head) < 2:
        return [fn(item) for item in itertools.chain(head, it)]
    results: list[R] = []
    pending: deque[Future[R] | _Ran[R]] = deque()
    with ThreadPoolExecutor(max_workers=limit, thread_name_prefix="zarrckpt") as pool:
        try:
            for item in itertools.chain(head, it):
                if len(pending) >= 4 * limit:
                    results.append(pending.popleft().result())  # raises the first failure, in order
                if inline is None or not inline(item):
                    pending.append(pool.submit(fn, item))
                    continue
                try:
                    pending.append(_Ran(fn(item)))
                except Exception as e:  # raised in its turn, after the earlier items' failures
                    pending.append(_Ran(None, e))
                    break
            while pending:
                results.append(pending.popleft().result())
        finally:
            for fut in pending:  # after a failure, start nothing more
                fut.cancel()
    return results


SMALL_LOCAL_WRITE = 256 * 1024  # local files: writes this small go in runs, on the calling thread while it is fast
LOCAL_BATCH = 64
# A run of small local writes taking longer than this per object (a network filesystem; a journal
# that stalls) sends the next runs to the threads. Measured per small object (a shard or a document,
# its directories made on the way), one thread: 26-34 us on tmpfs, 30-75 us on ext4.
SLOW_LOCAL_WRITE_S = 250e-6


class Pace:
    """Where each run of small local writes goes: the calling thread while the filesystem answers fast,
    else the threads (``limit`` runs at a time), trying the calling thread again after every ``limit``
    runs handed over. Small writes are mostly system calls, and every one of them passes the GIL on:
    threads sharing a few cores spend more on handing it over than the writes cost (20,000 small tensors
    on 2 cores, ext4: 5.75 s and 4.3 s of CPU on one thread against 6.75 s and 6.6 s on eight), while a
    filesystem that answers each call over a network needs many in flight. Slow means the last ``runs``
    runs on the calling thread all were: a journal that stalls now and then (one run in four on ext4
    here) is waited out faster on one thread than handed to eight."""

    def __init__(self, limit: int, slow_s: float = SLOW_LOCAL_WRITE_S, runs: int = 3) -> None:
        self.limit, self.slow_s = limit, slow_s
        self.caller = threading.get_ident()
        self.recent: deque[float] = deque(maxlen=runs)  # seconds per object of the last runs on the calling thread
        self.handed = 0  # runs handed to the threads since the last one here

    def inline(self, small: bool) -> bool:
        """Whether the next run (``small``: of small writes; a large write always goes to a thread) runs on
        the calling thread."""
        if not small:
            return False
        slow = len(self.recent) == self.recent.maxlen and min(self.recent) > self.slow_s
        if not slow or self.handed >= self.limit:
            self.handed = 0
            return True
        self.handed += 1
        return False

    def timed(self, fn: Callable[[T], int], run: list[T]) -> int:
        """``fn`` over ``run``: the sum of what it returned; on the calling thread, its pace is kept."""
        start = time.perf_counter()
        total = sum(map(fn, run))
        if threading.get_ident() == self.caller:
            self.recent.append((time.perf_counter() - start) / len(run))
        return total


def in_runs(items: Iterable[T], size: Callable[[T], int]) -> Iterator[list[T]]:
    """``items`` in order, each large one alone, small ones in runs of up to LOCAL_BATCH."""
    run: list[T] = []
    for item in items:
        if size(item) >= SMALL_LOCAL_WRITE:
            if run:
                yield run
                run = []
            yield [item]
            continue
        run.append(item)
        if len(run) == LOCAL_BATCH:
            yield run
            run = []
    if run:
        yield run
