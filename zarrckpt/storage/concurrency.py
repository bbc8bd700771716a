"""Bounded concurrency over a stream of items (the storage layer's reads and writes)."""

from __future__ import annotations

import itertools
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


SMALL_LOCAL_WRITE = 256 * 1024  # local files: writes this small are handed to the threads in runs
LOCAL_BATCH = 64


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
