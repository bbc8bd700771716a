"""CheckpointManager: periodic (async) saves under one root, retention, resume from the latest.

Built only on the public API. Checkpoints live at ``<root>/step_<10-digit step>``; only
committed ones count for ``steps()``, ``latest()`` and ``load_latest()``. A failed save is never
silent: it is logged at ERROR when it fails and raised as CheckpointSaveError by the next
``save()``, ``wait()`` or ``close()``; retention runs only after a successful save, so the newest
committed checkpoint survives every failed or running save. The manager never overwrites.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from zarrckpt.api import load, save
from zarrckpt.asyncsave import AsyncSave, Staging, async_save
from zarrckpt.deleter import Deleter
from zarrckpt.display import ProgressOption
from zarrckpt.engine.dist import Group, side_group
from zarrckpt.errors import CheckpointSaveError, ZarrckptError
from zarrckpt.lifecycle import DEFAULT_GRACE_SECONDS, await_dead_save
from zarrckpt.preemption import SignalWatch
from zarrckpt.retention import BestMode, Policy, SavedMetrics
from zarrckpt.storage.store import Storage
from zarrckpt.tier import LocalTier
from zarrckpt.tier.run import TierRunner
from zarrckpt.types import URL

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger("zarrckpt")


class CheckpointManager:
    """Save every ``interval`` steps to ``root_url``; keep the ``keep_last`` most recent
    checkpoints plus every ``keep_every``-th step plus (``keep_best``) the best by a metric; delete
    the rest in the background.

    Every rank calls ``save``/``load_latest``; listing and deletion run on rank 0 only. Retention
    deletes committed checkpoints only, each only while it still is one; ``cleanup()`` removes the
    leftovers of saves and deletions that died (no heartbeat for the lease). A save still running,
    this manager's or another's on the same root (a second job, a restarted job's predecessor), is
    never touched. ``grace_seconds``: leftovers whose marker has no heartbeat (a zarrckpt before
    heartbeats) count as dead once their save started this long ago.
    ``staging="background"`` (async saves): ``save()`` returns right after planning and the copy
    to host memory runs in the background; the loop calls ``wait_staged()`` before
    ``optimizer.step()``.

    Preemption (``save_on``): on one of these signals (Kubernetes and torchrun send SIGTERM before
    killing, Slurm ``--signal=USR1@120`` SIGUSR1), the next ``save()`` call, on every rank at the same
    step, waits for the save in flight and saves that step synchronously, whether due or not, and
    applies retention as after any save (``close()`` waits for it); then ``preempted`` is the signal
    and the loop should stop::

        manager = CheckpointManager(root, interval=100, keep_last=3, save_on=(signal.SIGTERM,))
        for step in range(start, steps):
            train_step()
            manager.save(step, state)  # every step: a no-op unless due, or preempted
            if manager.preempted:
                break
        manager.close()

    Args:
        root_url: where the checkpoints go (``<root>/step_<10-digit step>``).
        interval: save when the step is a multiple of this (``save(..., force=True)`` saves anyway).
        keep_last: how many of the most recent committed checkpoints retention keeps.
        keep_every: also keep every step that is a multiple of this (None: none).
        keep_best: also keep the ``keep_best`` checkpoints with the best ``best_metric`` (as Lightning's
            ``save_top_k`` with ``monitor``), lowest (``best_mode="min"``) or highest (``"max"``); each
            save passes its metrics (``save(step, sd, metrics={"val_loss": 0.31})``), which are saved
            in the checkpoint, so a restarted job ranks the old ones too. One without the metric is
            not ranked: it is kept while among the ``keep_last`` newest, then deleted with a WARNING
            (:mod:`zarrckpt.retention`).
        async_save: save with :func:`zarrckpt.async_save` (default) or synchronously.
        storage_options: as for :func:`zarrckpt.save`.
        process_group: as for :func:`zarrckpt.save`.
        delete_workers: threads deleting old checkpoints (rank 0).
        grace_seconds: see above.
        staging: ``"caller"`` or ``"background"``, as for :func:`zarrckpt.async_save`.
        progress: each save's progress, as for :func:`zarrckpt.save` (``True``: a line on stderr).
        local: a :class:`~zarrckpt.LocalTier`: also save every ``local.every`` steps to node-local
            storage with copies on peer nodes; ``load_latest`` then restores the newest step that
            survives there when it is at least as new as the remote one (docs/tiers.md).
        save_on: signals that ask for a final save (see above); their handlers are installed here
            (from the main thread) and the previous ones restored by ``close()``. ``save()`` must then
            be called every step on every rank: each call compares notes between ranks (one small
            all-gather), so that all of them save the same step.

    Raises:
        ZarrckptError: ``interval``, ``keep_last``, ``keep_every`` or ``keep_best`` below 1, ``keep_best``
            without ``best_metric``, ``best_mode`` not min or max; ``save_on`` given outside the main thread.
    """

    def __init__(
        self,
        root_url: URL,
        *,
        interval: int,
        keep_last: int,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: BestMode = "min",
        async_save: bool = True,
        storage_options: dict[str, Any] | None = None,
        process_group: ProcessGroup | None = None,
        delete_workers: int = 8,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        staging: Staging = "caller",
        progress: ProgressOption = False,
        save_on: Iterable[int] = (),
        local: LocalTier | None = None,
    ) -> None:
        self.policy = Policy(keep_last, keep_every, keep_best, best_metric, best_mode)
        self.policy.check(interval)
        self.root = str(root_url).rstrip("/")
        self.interval, self.keep_last, self.keep_every = interval, keep_last, keep_every
        self.metrics = SavedMetrics(best_metric or "", self.url, storage_options)  # (used with keep_best)
        self.use_async = async_save
        self.staging: Staging = staging  # async saves: "background" returns before the copy (see wait_staged)
        self.storage_options = storage_options
        self.progress = progress
        self.process_group = process_group
        self.grace_seconds = grace_seconds
        self.rank = Group(process_group).rank
        self._saving: tuple[int, Future[None]] | None = None  # the last save started, until its outcome is seen
        self.deleter = Deleter(
            self.root, self.url, self.policy, self.metrics, storage_options, grace_seconds, delete_workers
        )
        self._watch = SignalWatch(save_on) if save_on else None
        self.preempted: signal.Signals | None = None  # the signal a final save answered (see save_on)
        self.restored_from: Literal["local", "remote"] | None = None  # the tier load_latest restored from
        self.tier = TierRunner(local, process_group, staging) if local is not None else None
        if async_save:  # paid here, not in the first save: its process group (collective) and storage client
            side_group(process_group)
            Storage(self.root, storage_options)  # imports the client's modules (s3fs, ...); no request

    def url(self, step: int) -> str:
        return f"{self.root}/step_{step:010d}"

    def save(
        self, step: int, state_dict: Any, *, force: bool = False, metrics: dict[str, Any] | None = None
    ) -> Future[None] | None:
        """Save when ``step`` is due (a multiple of ``interval``) or ``force``; else do nothing.
        ``metrics`` (name -> number; rank 0's are saved, other ranks may pass theirs or None) are saved
        with it, as ``zarrckpt_manager.metrics``; ``keep_best`` ranks by them (:mod:`zarrckpt.retention`).

        Returns the save's future (already done for synchronous saves), or None when not due.

        Raises:
            CheckpointSaveError: this save failed (synchronous mode), or the previous
                (asynchronous) one did; the cause is chained. Raised once per failed save. When the
                previous save's failure is raised, ``step`` is not saved: the message names it, and
                ``skipped_step`` holds it (None when ``step`` was not due anyway).
        """
        if self.preempted is not None:
            raise ZarrckptError(
                f"the job was preempted ({self.preempted.name}) and its last step saved: stop training, and close()"
            )
        if self._watch is not None and self._signalled():
            return self._final_save(step, state_dict, metrics)
        due = step >= 0 and (force or step % self.interval == 0)
        if self.tier is not None and self.tier.due(step):
            self.tier.start(step, state_dict)  # (raises the previous local save's failure first)
        try:
            self._check_previous()
        except CheckpointSaveError as e:
            if not due:
                raise
            skipped = CheckpointSaveError(f"{e}. Step {step} was not saved: call save({step}, ...) again to save it")
            skipped.skipped_step = step
            raise skipped from e.__cause__
        if not due:
            return None
        future = self._start(step, state_dict, self.use_async, metrics)
        self._saving = (step, future)
        if self.rank == 0:  # queued now, so wait() / close() cannot miss it
            self.deleter.after(future)
        return future

    def _start(self, step: int, state_dict: Any, use_async: bool, metrics: dict[str, Any] | None) -> Future[None]:
        """Save ``step`` (asynchronously: started; else done, or CheckpointSaveError)."""
        url, opts, group = self.url(step), self.storage_options, self.process_group
        state_dict = self.metrics.note(step, state_dict, metrics, self.rank == 0)
        if self.rank == 0:  # a restarted job: its predecessor may have died saving this very step
            await_dead_save(url, storage_options=opts)  # (its save is then taken over; a live one never)
        if use_async:
            future = async_save(
                state_dict, url, storage_options=opts, process_group=group, staging=self.staging, progress=self.progress
            )
            future.add_done_callback(partial(self._log_failure, step))
            return future
        try:
            save(state_dict, url, storage_options=opts, process_group=group, progress=self.progress)
        except Exception as e:
            raise self._failure(step, e) from e
        return _completed()

    def _signalled(self) -> bool:
        """Whether any rank got a ``save_on`` signal (every rank calls it at each ``save()``)."""
        assert self._watch is not None
        mine = self._watch.signalled
        seen = [int(s) for s in Group(self.process_group).all_gather_json(int(mine) if mine else 0) if s]
        if seen:
            self._signal = signal.Signals(seen[0])
        return bool(seen)

    def _final_save(self, step: int, state_dict: Any, metrics: dict[str, Any] | None) -> Future[None]:
        """Preempted: wait for the save in flight, then save ``step`` synchronously (unless it was that one)."""
        previous = self._saving[0] if self._saving is not None else None
        try:
            self._check_previous()
            done = previous == step
        except CheckpointSaveError as e:  # the final save still goes on
            log.error("%s", e)
            done = False
        future = _completed() if done else self._start(step, state_dict, False, metrics)
        self.preempted = self._signal
        if self.rank == 0:
            log.warning("%s received: saved step %d to %s; stop now", self._signal.name, step, self.url(step))
            if not done:  # (done: the save in flight was this step, and queued its retention)
                self.deleter.now()  # a preempted job leaves keep_last, not keep_last + 1
        return future

    def wait_staged(self) -> None:
        """Block until the save in flight has copied the state to host memory. With
        ``staging="background"``, call it before anything changes the state (``optimizer.step()``);
        with the default ``"caller"`` staging, and between saves, it returns at once.

        Raises:
            CheckpointSaveError: the copy failed (nothing is committed; raised once, here).
        """
        if self.tier is not None:
            self.tier.wait_staged()
        if self._saving is None:
            return
        step, future = self._saving
        if not isinstance(future, AsyncSave):
            return
        try:
            future.wait_staged()
        except Exception as e:
            wait_for([future])  # the save ends too: it commits nothing
            self._saving = None
            raise self._failure(step, e) from e

    def _failure(self, step: int, error: BaseException) -> CheckpointSaveError:
        return CheckpointSaveError(
            f"the save of step {step} to {self.url(step)} failed, nothing was committed for it: "
            f"{type(error).__name__}: {error}"
        )

    def _log_failure(self, step: int, future: Future[None]) -> None:
        error = future.exception()
        if error is not None:
            log.error("%s", self._failure(step, error))

    def _check_previous(self) -> None:
        """Wait for the save in flight; raise its failure (once)."""
        if self._saving is None:
            return
        step, future = self._saving
        wait_for([future])
        self._saving = None
        error = future.exception()
        if error is not None:
            raise self._failure(step, error) from error

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return self.deleter.steps()

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def load_latest(self, state_dict: Any, **kwargs: Any) -> int | None:
        """Load the latest committed checkpoint into ``state_dict``; returns its step (None: none yet).

        Every rank calls it; rank 0 decides which step, so all ranks load the same one. With a
        ``local`` tier, the step may be a local one; ``restored_from`` then says which tier it came
        from (``"local"``, ``"remote"``; None: nothing was restored).
        """
        self.restored_from = None
        chosen = Group(self.process_group).all_gather_json(self.latest() if self.rank == 0 else None)[0]
        if self.tier is not None and (local := self.tier.restore_newest(state_dict, chosen, **kwargs)) is not None:
            self.restored_from = "local"
            return local
        if chosen is None:
            return None
        step = int(chosen)
        load(
            state_dict, self.url(step), storage_options=self.storage_options, process_group=self.process_group, **kwargs
        )
        self.restored_from = "remote"
        return step

    def cleanup(self, *, all_incomplete: bool = False) -> list[int]:
        """Delete leftovers (rank 0), in the background: finish deletions that died, and remove
        incomplete checkpoints whose save died (no heartbeat for the lease, or its writer provably
        gone), or whose marker, written by a zarrckpt without heartbeats, is older than
        ``grace_seconds``; returns their steps. A save or deletion still running is never touched,
        whoever runs it (another job saving to this root, a restarted job's predecessor).

        ``all_incomplete=True`` also removes incomplete ones whose marker has no heartbeat, whatever
        its age: call it when no save of such an older zarrckpt can be running.
        """
        return self.deleter.cleanup(all_incomplete) if self.rank == 0 else []

    def wait(self) -> None:
        """Wait for the save in flight and for deletions.

        Raises:
            CheckpointSaveError: the save in flight (or an earlier, unreported one) failed.
        """
        try:
            self._check_previous()
            if self.tier is not None:
                self.tier.check()
        finally:
            self.deleter.wait()

    def close(self) -> None:
        """Wait for the save in flight and for deletions, then stop the deleter.

        Raises:
            CheckpointSaveError: the last save failed (after everything else has finished).
        """
        try:
            self.wait()
        finally:
            self.deleter.shutdown()
            if self._watch is not None:
                self._watch.close()


def _completed() -> Future[None]:
    """A future already done (a synchronous save's)."""
    future: Future[None] = Future()
    future.set_result(None)
    return future
