"""A :class:`~zarrckpt.CheckpointManager`'s deletions (rank 0, in the background): retention after each
save, and the leftovers of saves and deletions that died.

Retention deletes committed checkpoints only, each only while it still is one; leftovers only while
they still are what they were found as (:func:`zarrckpt.lifecycle.remove_leftover`). A step is
deleted once however many retention passes find it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from functools import partial
from typing import Any

from zarrckpt.lifecycle import STEP_NAME, Entry, committed_steps, delete, is_leftover, remove_leftover, scan
from zarrckpt.retention import Policy, SavedMetrics

log = logging.getLogger("zarrckpt")


class Deleter:
    """Background deletions under ``root`` (checkpoints at ``url(step)``)."""

    def __init__(
        self,
        root: str,
        url: Callable[[int], str],
        policy: Policy,
        metrics: SavedMetrics,
        storage_options: dict[str, Any] | None,
        grace_seconds: float,
        workers: int,
    ) -> None:
        self.root, self.url, self.policy, self.metrics = root, url, policy, metrics
        self.storage_options, self.grace_seconds = storage_options, grace_seconds
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zarrckpt-delete")
        self._deleting: list[Future[None]] = []  # background work (guarded by _lock)
        self._doomed: set[int] = set()  # steps queued for deletion or being deleted (guarded by _lock)
        self._lock = threading.Lock()

    def steps(self) -> list[int]:
        return committed_steps(self.root, storage_options=self.storage_options)

    def after(self, saving: Future[None]) -> None:
        """Apply retention once ``saving`` has succeeded (queued now: :meth:`wait` cannot miss it)."""
        self.run(partial(self._retain_after, saving))

    def now(self) -> None:
        """Apply retention now (in the background)."""
        self.run(self._retain)

    def run(self, fn: Any) -> None:
        future = self.pool.submit(fn)  # (not under the lock: the work takes it)
        with self._lock:
            self._deleting.append(future)

    def _retain_after(self, saving: Future[None]) -> None:
        if saving.exception() is None:  # blocks until the save is done
            self._retain()

    def _retain(self) -> None:
        steps = self.steps()
        with self._lock:
            doomed = set(self._doomed)
        keep = self.policy.keep(steps, self.metrics.of(steps) if self.policy.keep_best else {}, doomed)
        for step in steps:
            if step not in keep:
                self._delete(step, None)
        self.cleanup()

    def cleanup(self, all_incomplete: bool = False) -> list[int]:
        """Queue the deletion of leftovers (see :meth:`zarrckpt.CheckpointManager.cleanup`); their steps."""
        found = [
            (e, int(m.group(1)))
            for e in scan(self.root, storage_options=self.storage_options)
            if (m := STEP_NAME.match(e.name))
        ]
        stale = {
            step: e
            for e, step in found
            if is_leftover(e, self.grace_seconds) or (all_incomplete and e.state == "incomplete" and not e.lease)
        }
        for step, entry in sorted(stale.items()):
            self._delete(step, entry)
        return sorted(stale)

    def _delete(self, step: int, leftover: Entry | None) -> None:
        """Delete ``step`` in the background: the committed checkpoint retention chose (``leftover`` None),
        or the leftover ``leftover``; either only while it still is what it was chosen as."""
        with self._lock:  # (retention after the next save may find it still listed: delete it once)
            if step in self._doomed:
                return
            self._doomed.add(step)
        log.info("deleting %s %s", "checkpoint" if leftover is None else f"{leftover.state} leftover", self.url(step))
        self.run(partial(self._delete_one, step, leftover))

    def _delete_one(self, step: int, leftover: Entry | None) -> None:
        try:
            if leftover is None:
                delete(self.url(step), storage_options=self.storage_options, committed_only=True)
            else:
                remove_leftover(leftover, storage_options=self.storage_options)
        finally:
            with self._lock:
                self._doomed.discard(step)

    def wait(self) -> None:
        """Wait for every queued deletion (those it queues too); failures are logged."""
        while True:
            with self._lock:
                pending = list(self._deleting)
            if not pending:
                return
            done, _ = wait_for(pending)
            with self._lock:
                self._deleting = [f for f in self._deleting if f not in done]
            for f in done:
                if f.exception() is not None:
                    log.warning("deleting an old checkpoint failed: %s", f.exception())

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)
