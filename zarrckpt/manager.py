"""CheckpointManager: periodic (async) saves under one root, retention, resume from the latest.

Built only on the public API. Checkpoints live at ``<root>/step_<10-digit step>``; only
committed ones count for ``steps()``, ``latest()`` and ``load_latest()``.
"""

from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from functools import partial
from typing import Any

import torch.distributed as torch_dist

from .api import delete, list_checkpoints, load, save
from .asyncsave import async_save
from .dist import Group
from .errors import ZarrckptError

log = logging.getLogger("zarrckpt")
_STEP = re.compile(r"^step_(\d{10})$")


class CheckpointManager:
    """Save every ``interval`` steps to ``root_url``; keep the ``keep_last`` most recent
    checkpoints plus every ``keep_every``-th step; delete the rest in the background.

    Every rank calls ``save``/``load_latest``; listing and deletion run on rank 0 only.
    """

    def __init__(
        self,
        root_url: str,
        *,
        interval: int,
        keep_last: int,
        keep_every: int | None = None,
        async_save: bool = True,
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        delete_workers: int = 8,
    ) -> None:
        if interval < 1 or keep_last < 1 or (keep_every is not None and keep_every < 1):
            raise ZarrckptError("CheckpointManager: interval and keep_last must be >= 1 (keep_every too, if given)")
        self.root = str(root_url).rstrip("/")
        self.interval, self.keep_last, self.keep_every = interval, keep_last, keep_every
        self.use_async = async_save
        self.storage_options = storage_options
        self.process_group = process_group
        self.rank = torch_dist.get_rank(process_group) if torch_dist.is_initialized() else 0
        self._saving: Future[None] | None = None
        self._deleter = ThreadPoolExecutor(max_workers=delete_workers, thread_name_prefix="zarrckpt-delete")
        self._deleting: list[Future[None]] = []  # background retention work (guarded by _lock)
        self._lock = threading.Lock()

    def url(self, step: int) -> str:
        return f"{self.root}/step_{step:010d}"

    def save(self, step: int, state_dict: Any, *, force: bool = False) -> Future[None] | None:
        """Save when ``step`` is due (a multiple of ``interval``) or ``force``; else do nothing.

        Returns the save's future (already done for synchronous saves), or None when not due.
        """
        if step < 0 or (not force and step % self.interval):
            return None
        url = self.url(step)
        if self.use_async:
            future = async_save(state_dict, url, storage_options=self.storage_options, process_group=self.process_group)
        else:
            save(state_dict, url, storage_options=self.storage_options, process_group=self.process_group)
            future = Future()
            future.set_result(None)
        self._saving = future
        if self.rank == 0:  # queued now, so wait() / close() cannot miss it
            self._background(partial(self._retain_after, future))
        return future

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return sorted(
            int(m.group(1))
            for name, state in list_checkpoints(self.root, storage_options=self.storage_options).items()
            if state == "committed" and (m := _STEP.match(name))
        )

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def load_latest(self, state_dict: Any, **kwargs: Any) -> int | None:
        """Load the latest committed checkpoint into ``state_dict``; returns its step (None: none yet).

        Every rank calls it; rank 0 decides which step, so all ranks load the same one.
        """
        step = Group(self.process_group).all_gather_json(self.latest() if self.rank == 0 else None)[0]
        if step is None:
            return None
        load(
            state_dict, self.url(step), storage_options=self.storage_options, process_group=self.process_group, **kwargs
        )
        return step

    def cleanup(self, *, all_incomplete: bool = False) -> list[int]:
        """Delete uncommitted leftovers (rank 0); returns their steps.

        By default only those older than the latest committed step (a newer one may still be
        being written). ``all_incomplete=True`` deletes every one: call it when no save can be
        running, e.g. when a job restarts after a crash, before ``load_latest``.
        """
        if self.rank != 0:
            return []
        found = list_checkpoints(self.root, storage_options=self.storage_options)
        committed = [int(m.group(1)) for n, s in found.items() if s == "committed" and (m := _STEP.match(n))]
        newest = max(committed, default=-1)
        stale = [int(m.group(1)) for n, s in found.items() if s == "incomplete" and (m := _STEP.match(n))]
        stale = [s for s in stale if all_incomplete or s < newest]
        self._delete(stale)
        return stale

    def _background(self, fn: Any) -> None:
        with self._lock:
            self._deleting.append(self._deleter.submit(fn))

    def _retain_after(self, saving: Future[None]) -> None:
        if saving.exception() is None:  # blocks until the save is done
            self._retain()

    def _retain(self) -> None:
        steps = self.steps()
        keep = set(steps[-self.keep_last :])
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        self._delete([s for s in steps if s not in keep])
        self.cleanup()

    def _delete(self, steps: list[int]) -> None:
        for step in steps:
            log.info("deleting checkpoint %s", self.url(step))
            self._background(partial(delete, self.url(step), storage_options=self.storage_options))

    def wait(self) -> None:
        """Wait for the save in flight and for deletions; re-raise a failed save."""
        if self._saving is not None:
            self._saving.result()
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

    def close(self) -> None:
        """Wait for the save in flight (its failure, if any, is on its future) and for deletions."""
        if self._saving is not None:
            wait_for([self._saving])
            self._saving = None
        self.wait()
        self._deleter.shutdown(wait=True)
