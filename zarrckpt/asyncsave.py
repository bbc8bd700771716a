"""``async_save``: stage to host memory, return, and write in the background.

The caller's thread collects the state and agrees on the plan with the other ranks (so layout
errors raise right away). Then every local tensor is copied to host memory (pinned when it
lives on a GPU): on the caller's thread by default (``staging="caller"``: the call returns once
the copies are done), or on a staging thread (``staging="background"``: the call returns right
after planning, and the training loop must call ``wait_staged()`` before it changes the state,
i.e. before ``optimizer.step()``; the writing thread first sends the parts of small joined
tensors to their writers, then the copy starts). A background thread prepares the location, writes each
tensor's shards as soon as it is staged, and commits. With a staging budget, staged-but-unwritten
bytes never exceed it: staging waits for the writer to free room.

``ZARRCKPT_CHECK_STAGING=1`` (debugging): a crc32c of every tensor is taken when ``async_save``
is called and compared with its staged copy, so a state changed before staging finished fails
the save (nothing is committed) instead of committing a torn checkpoint.

Background collectives use a process group of their own (gloo), created on the first call, so
they never interleave with the training loop's collectives.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import crc32c
import torch

from zarrckpt.display import Meter, ProgressOption, watch
from zarrckpt.engine import commit as protocol
from zarrckpt.engine import markers
from zarrckpt.engine.dist import Group, side_group
from zarrckpt.engine.exchange import gather_small
from zarrckpt.engine.saveplan import plan_save
from zarrckpt.engine.writer import commit_save
from zarrckpt.errors import ZarrckptError
from zarrckpt.format import dtypes, integrity
from zarrckpt.format.layout import ChunkRule, chunk_rule
from zarrckpt.plan import stateful
from zarrckpt.plan.localstate import LocalState, LocalTensor, collect
from zarrckpt.plan.names import check_names
from zarrckpt.plan.save import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES, ZarrSavePlan
from zarrckpt.staging import Handoff, StagingStats, stage, write_staged
from zarrckpt.storage.store import Storage
from zarrckpt.storage.traffic import Traffic
from zarrckpt.types import URL

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger("zarrckpt")
Staging = Literal["caller", "background"]


class _Background:
    """The threads async saves run on, and the save in flight: one writer (a save at a time) and one
    stager (``staging="background"``); a save still running when the process exits finishes first."""

    def __init__(self) -> None:
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zarrckpt-async")
        self.stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zarrckpt-stage")
        self.last: AsyncSave | None = None
        self.lock = threading.Lock()  # one async_save call at a time
        atexit.register(self.writer.shutdown, wait=True)
        atexit.register(self.stager.shutdown, wait=True)


_background = _Background()


class AsyncSave(Future[None]):
    """What :func:`async_save` returns: a future that completes when the checkpoint is committed
    (or carries the error). ``staged`` is a future of this rank's :class:`StagingStats`: done
    once every tensor is copied to host memory (or carrying the error that stopped the copy).
    ``stats()``: this rank's requests and bytes, as :func:`zarrckpt.save` returns them."""

    def __init__(self, traffic: Traffic | None = None) -> None:
        super().__init__()
        self.staged: Future[StagingStats] = Future()
        self._traffic = traffic if traffic is not None else Traffic()

    def stats(self) -> dict[str, int]:
        """What this save has cost its store on this rank so far (final once the future is done):
        ``{"requests", "retries", "bytes_read", "bytes_written"}``, as :meth:`zarrckpt.Checkpoint.stats`."""
        return self._traffic.snapshot()

    def wait_staged(self, timeout: float | None = None) -> StagingStats:
        """Block until the state is staged; after this the training loop may change it.

        Raises:
            Exception: what stopped the copy (the save then commits nothing).
        """
        return self.staged.result(timeout)

    @property
    def staging(self) -> StagingStats:
        """This rank's staging statistics (waits for staging to finish)."""
        return self.wait_staged()

    def _run(self, fn: Any) -> None:
        """Executor thread: run ``fn`` as this future's work (what ``Executor.submit`` does)."""
        if not self.set_running_or_notify_cancel():
            return
        try:
            fn()
        except BaseException as e:
            self.set_exception(e)
        else:
            self.set_result(None)


def async_save(
    state_dict: Mapping[str, Any],
    url: URL,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: ProcessGroup | None = None,
    overwrite: bool = False,
    staging_budget_bytes: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    small_tensor_bytes: int = DEFAULT_SMALL_TENSOR_BYTES,
    check_replicas: bool = True,
    allow_pickle: bool = False,
    staging: Staging = "caller",
    verify_after_save: bool | None = None,
    progress: ProgressOption = False,
    chunk_policy: str = "rows",
) -> AsyncSave:
    """Start saving ``state_dict`` to ``url``; every rank calls it.

    One save is in flight at a time: a call first waits for the previous one to finish.

    Args:
        staging: ``"caller"`` (default): return once every tensor is copied to host memory, after
            which the state may change. ``"background"``: return right after planning; the copies
            run on a staging thread, and the caller must not change the state (no
            ``optimizer.step()``) before ``wait_staged()`` returns: a tensor changed earlier
            would be saved half old, half new. ``ZARRCKPT_CHECK_STAGING=1`` checks that (costs
            a crc32c of the whole state on the caller's thread).
        staging_budget_bytes: bound on the host memory holding staged copies (default: none).
        overwrite: as for :func:`zarrckpt.save`.
        chunk_bytes: as for :func:`zarrckpt.save`.
        chunk_policy: as for :func:`zarrckpt.save`.
        small_tensor_bytes: as for :func:`zarrckpt.save` (the parts of small tensors are sent to
            their writers before the call returns with ``staging="caller"``; with ``"background"``,
            by the writing thread before the copy, so before ``wait_staged()`` returns).
        check_replicas: as for :func:`zarrckpt.save`.
        allow_pickle: as for :func:`zarrckpt.save`.
        verify_after_save: as for :func:`zarrckpt.save`.
        progress: as for :func:`zarrckpt.save` (drawn and called from the writing threads).

    Returns:
        An :class:`AsyncSave`: a future that completes when the checkpoint is committed (or
        carries the error), with ``staged`` / ``wait_staged()`` for the copy to host memory and
        ``stats()`` for this rank's requests and bytes (as :func:`zarrckpt.save` returns them).

    Raises:
        SaveLayoutError: layout and replica problems, before the call returns (nothing written).
        ZarrckptError: ``staging`` is neither ``"caller"`` nor ``"background"``.
    """
    rule = chunk_rule(chunk_bytes, chunk_policy)
    if staging not in ("caller", "background"):
        raise ZarrckptError(f"async_save: staging must be 'caller' or 'background', not {staging!r}")
    storage = Storage(url, storage_options, verify_writes=verify_after_save)

    def job(plan: ZarrSavePlan, group: Group, handoff: Handoff, bar: Meter, exchange: Exchange | None) -> _Job:
        return _Job(storage, plan, group, overwrite, handoff, bar, exchange)

    options = Options(rule, check_replicas, small_tensor_bytes, allow_pickle, staging, staging_budget_bytes, progress)
    return launch(_background, state_dict, storage, job, options, process_group=process_group)


@dataclass(frozen=True)
class Options:
    """What :func:`launch` needs of a save's options."""

    rule: int | ChunkRule
    check_replicas: bool
    small_tensor_bytes: int
    allow_pickle: bool
    staging: Staging
    staging_budget_bytes: int | None
    progress: ProgressOption


Exchange = tuple[LocalState, threading.Event]  # the small-tensor exchange a job runs first, and its end


def launch(
    background: _Background,
    state_dict: Mapping[str, Any],
    storage: Storage,
    make_job: Callable[[ZarrSavePlan, Group, Handoff, Meter, Exchange | None], Any],
    options: Options,
    *,
    process_group: ProcessGroup | None,
    side: str = "",
) -> AsyncSave:
    """Collect and plan on the caller's thread, then run ``make_job(...).run`` on ``background``'s
    writer (collectives on the side group named ``side``), staging as ``options.staging`` says; the
    machinery of :func:`async_save`, and of the local tier's saves (:mod:`zarrckpt.tier.save`)."""
    with background.lock:
        if background.last is not None:
            wait_for([background.last])
        group = Group(process_group)
        resolved, _ = stateful.resolve(state_dict)
        local = group.run_together(
            lambda: collect(resolved, options.allow_pickle, group.rank, group.size), "collecting the state dict"
        )
        # staging in the background: the small-tensor exchange runs on the writer thread too, before the copy
        later = options.staging == "background"
        names = partial(check_names, limits=storage.name_limits, where=storage.url)  # raises here, at the call
        plan = plan_save(
            group,
            local,
            options.rule,
            options.check_replicas,
            options.small_tensor_bytes,
            exchange=not later,
            check=names,
        )
        side_ranks = side_group(process_group, side) if group.active else group
        handoff = Handoff(options.staging_budget_bytes)
        expected: dict[int, tuple[LocalTensor, int]] | None = None
        if os.environ.get("ZARRCKPT_CHECK_STAGING", "") not in ("", "0"):
            expected = {id(t): (t, _digest(t.data)) for t in local.parts()}  # (t: its id is not reused)
        progress = options.progress
        whole = plan.total_bytes() if progress is True and group.rank == 0 else None  # (rank 0's plan: every array)
        bar = watch(storage, progress, f"save {storage.url}", plan.bytes_of(group.rank), group.rank, group.size, whole)
        exchanged = threading.Event()
        job = make_job(plan, side_ranks, handoff, bar, (local, exchanged) if later else None)
        future = AsyncSave(storage.traffic)
        background.writer.submit(future._run, job.run)
        background.last = future
        if options.staging == "caller":
            _stage(future.staged, handoff, local, expected)
            future.staged.result()  # the copy's error raises here, on the caller's thread
        else:
            background.stager.submit(_stage, future.staged, handoff, local, expected, exchanged)
        return future


def _digest(t: torch.Tensor) -> int:
    return crc32c.crc32c(dtypes.as_numpy(t.detach().cpu().contiguous()).reshape(-1).view("u1").data)


def _stage(
    staged: Future[StagingStats],
    handoff: Handoff,
    local: LocalState,
    expected: dict[int, tuple[LocalTensor, int]] | None,
    after: threading.Event | None = None,
) -> None:
    """Copy each local tensor to host memory within the budget (on the caller's or the staging
    thread), once ``after`` is set (the writer's small-tensor exchange, which changes ``local``);
    ``staged`` gets the statistics or the error, and so does the writer."""

    def unchanged(tensor: LocalTensor, host: torch.Tensor) -> None:
        held, want = (None, 0) if expected is None else expected.get(id(tensor), (None, 0))
        if held is tensor and _digest(host) != want:  # (a joined small tensor is a copy: not checked)
            raise ZarrckptError(
                f"async_save: {tensor.key!r} changed before it was staged (ZARRCKPT_CHECK_STAGING): the state "
                "was modified (optimizer.step()?) before wait_staged() returned; nothing was committed"
            )

    try:
        if after is not None:
            after.wait()
        stats = stage(handoff, local.parts(), None if expected is None else unchanged)
    except BaseException as e:
        handoff.finish(e)  # (a no-op when stage() already told the writer)
        staged.set_exception(e)
        return
    log.info(
        "async save staged %d tensors in %.3fs, peak %d bytes staged", stats.tensors, stats.seconds, stats.peak_bytes
    )
    staged.set_result(stats)


@dataclass
class _Job:
    """The writer thread's part of one async save: prepare, write tensors as they are staged, commit."""

    storage: Storage
    plan: ZarrSavePlan
    group: Group
    overwrite: bool
    handoff: Handoff
    bar: Meter  # progress (inactive unless asked for)
    exchange: Exchange | None = None  # the small-tensor exchange to run first, and its end
    written: integrity.Written = field(default_factory=dict)  # chunk checksums, for the manifest

    def run(self) -> None:
        save_id = ""
        try:
            if self.exchange is not None:
                self._exchange(*self.exchange)
            save_id = self.group.run_together(self._prepare, "preparing", share=True)
            self.storage.guard = markers.Ownership(self.storage, save_id).check
            self.group.run_together(self._write_all, "writing shards")
            commit_save(self.storage, self.group, self.plan, save_id, self.written)
        except BaseException:
            self.handoff.abandon()
            if save_id:  # rank 0: the heartbeat stops, and the next save may take the leftovers over
                markers.abandon(self.storage, save_id)
            self.bar.abort()
            raise
        self.bar.finish()

    def _exchange(self, local: LocalState, done: threading.Event) -> None:
        """Hand each small tensor's writer its parts; the stager waits for it (and stops if it failed)."""
        try:
            gather_small(self.group, self.plan, local)
        except BaseException:
            self.handoff.abandon()
            raise
        finally:
            done.set()

    def _prepare(self) -> str:
        return protocol.prepare(self.storage, self.overwrite, self.group.size) if self.group.rank == 0 else ""

    def _write_all(self) -> None:
        write_staged(self.storage, self.plan, self.handoff, self.group.rank, self.written)
