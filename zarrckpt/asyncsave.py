"""``async_save``: stage to host memory, return, and write in the background.

The caller's thread collects the state and agrees on the plan with the other ranks (so layout
errors raise right away). Then every local tensor is copied to host memory (pinned when it
lives on a GPU): on the caller's thread by default (``staging="caller"``: the call returns once
the copies are done), or on a staging thread (``staging="background"``: the call returns right
after planning, and the training loop must call ``wait_staged()`` before it changes the state,
i.e. before ``optimizer.step()``). A background thread prepares the location, writes each
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
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import crc32c
import torch

from . import commit as protocol
from . import dtypes, integrity, stateful
from .dist import Group, side_group
from .errors import ZarrckptError
from .format import ArrayMeta
from .layout import Shape
from .localstate import LocalState, LocalTensor, collect
from .plan import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_TENSOR_BYTES, ZarrSavePlan
from .storage import Storage
from .types import URL
from .writer import commit_save, plan_save, write_rank

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger("zarrckpt")
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zarrckpt-async")
_stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zarrckpt-stage")  # staging="background"
_last: AsyncSave | None = None
_lock = threading.Lock()
# Host staging buffers, kept for the next async_save (no fresh allocation and page faults each
# time); holds at most what one save had staged at once. release_staging() frees them.
_pool: dict[tuple[Any, ...], list[torch.Tensor]] = {}
_pool_lock = threading.Lock()
atexit.register(_executor.shutdown, wait=True)  # a save in flight finishes before the process exits
atexit.register(_stager.shutdown, wait=True)
Staging = Literal["caller", "background"]


@dataclass(frozen=True)
class StagingStats:
    """How the copy to host memory went, on this rank (known once ``async_save`` returns)."""

    tensors: int = 0
    """Local tensors copied."""
    seconds: float = 0.0
    """Time the copies took (what the caller waited for them)."""
    peak_bytes: int = 0
    """The most bytes staged but not yet written at any moment (at most the staging budget, unless one
    tensor alone is larger)."""


class AsyncSave(Future[None]):
    """What :func:`async_save` returns: a future that completes when the checkpoint is committed
    (or carries the error). ``staged`` is a future of this rank's :class:`StagingStats`: done
    once every tensor is copied to host memory (or carrying the error that stopped the copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.staged: Future[StagingStats] = Future()

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
        overwrite, chunk_bytes, small_tensor_bytes, check_replicas, allow_pickle: as for
            :func:`zarrckpt.save` (the parts of small tensors are sent to their writers before
            the call returns, whatever ``staging``).

    Returns:
        An :class:`AsyncSave`: a future that completes when the checkpoint is committed (or
        carries the error), with ``staged`` / ``wait_staged()`` for the copy to host memory.

    Raises:
        SaveLayoutError: layout and replica problems, before the call returns (nothing written).
        ZarrckptError: ``staging`` is neither ``"caller"`` nor ``"background"``.
    """
    if staging not in ("caller", "background"):
        raise ZarrckptError(f"async_save: staging must be 'caller' or 'background', not {staging!r}")
    global _last
    with _lock:
        if _last is not None:
            wait_for([_last])
        group = Group(process_group)
        resolved, _ = stateful.resolve(state_dict)
        local = group.run_together(lambda: collect(resolved, allow_pickle), "collecting the state dict")
        plan = plan_save(group, local, chunk_bytes, check_replicas, small_tensor_bytes)
        background = side_group(process_group) if group.active else group
        job = _Job(Storage(url, storage_options), plan, background, overwrite, staging_budget_bytes)
        if os.environ.get("ZARRCKPT_CHECK_STAGING", "") not in ("", "0"):
            job.expected = {id(t): _digest(t.data) for t in local.parts()}
        future = AsyncSave()
        _executor.submit(future._run, job.run)
        _last = future
        if staging == "caller":
            _stage_into(future.staged, job, local)
            future.staged.result()  # the copy's error raises here, on the caller's thread
        else:
            _stager.submit(_stage_into, future.staged, job, local)
        return future


def _stage_into(staged: Future[StagingStats], job: _Job, local: LocalState) -> None:
    try:
        staged.set_result(job.stage(local))
    except BaseException as e:
        staged.set_exception(e)


def _digest(t: torch.Tensor) -> int:
    return crc32c.crc32c(dtypes.as_numpy(t.detach().cpu().contiguous()).reshape(-1).view("u1").data)


@dataclass
class _Job:
    storage: Storage
    plan: ZarrSavePlan
    group: Group
    overwrite: bool
    budget: int | None
    staged: list[LocalTensor | None] = field(default_factory=list)  # None marks the end
    in_flight: int = 0  # staged bytes not yet written
    peak: int = 0
    failed: bool = False
    stage_failed: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)
    written: integrity.Written = field(default_factory=dict)  # chunk checksums, for the manifest
    expected: dict[int, int] | None = None  # ZARRCKPT_CHECK_STAGING: id(part) -> crc32c at the call
    stage_error: BaseException | None = None

    def stage(self, local: LocalState) -> StagingStats:
        """Caller's thread: copy each local tensor to host memory, within the budget.

        If staging fails, the background save is told so and abandons the checkpoint uncommitted.
        """
        try:
            return self._stage(local)
        except BaseException as e:
            with self.cond:
                self.stage_failed, self.stage_error = True, e
                self.staged.append(None)
                self.cond.notify_all()
            raise

    def _stage(self, local: LocalState) -> StagingStats:
        start = time.perf_counter()
        copied = 0
        for tensor in local.parts():
            nbytes = tensor.data.nbytes
            with self.cond:
                self.cond.wait_for(partial(self._ready_for, nbytes))
                if self.failed:
                    return StagingStats(copied, time.perf_counter() - start, self.peak)
            host = _to_host(tensor.data)
            if self.expected is not None and _digest(host) != self.expected[id(tensor)]:
                _recycle(host)
                raise ZarrckptError(
                    f"async_save: {tensor.key!r} changed before it was staged (ZARRCKPT_CHECK_STAGING): the state "
                    "was modified (optimizer.step()?) before wait_staged() returned; nothing was committed"
                )
            with self.cond:
                self.in_flight += nbytes
                self.peak = max(self.peak, self.in_flight)
                self.staged.append(LocalTensor(**{**tensor.__dict__, "data": host}))
                self.cond.notify_all()
            copied += 1
        with self.cond:
            self.staged.append(None)
            self.cond.notify_all()
        stats = StagingStats(copied, time.perf_counter() - start, self.peak)
        log.info(
            "async save staged %d tensors in %.3fs, peak %d bytes staged",
            stats.tensors,
            stats.seconds,
            stats.peak_bytes,
        )
        return stats

    def _ready_for(self, nbytes: int) -> bool:
        """True once ``nbytes`` more fit in the budget (a tensor larger than it goes alone), or on failure."""
        fits = self.budget is None or self.in_flight == 0 or self.in_flight + nbytes <= self.budget
        return self.failed or fits

    def run(self) -> None:
        """Background thread: prepare, write tensors as they are staged, commit."""
        try:
            save_id = self.group.run_together(self._prepare, "preparing")
            self.group.run_together(self._write_all, "writing shards")
            commit_save(self.storage, self.group, self.plan, save_id, self.written)
        except BaseException:
            with self.cond:
                self.failed = True
                self.cond.notify_all()
            raise

    def _prepare(self) -> str:
        return protocol.prepare(self.storage, self.overwrite) if self.group.rank == 0 else ""

    def _write_all(self) -> None:
        rank = self.group.rank
        mine: dict[str, list[tuple[ArrayMeta, Shape]]] = {}
        for meta, idx in self.plan.shards_of(rank):
            mine.setdefault(meta.key, []).append((meta, idx))
        if self.budget is None:  # no bound: let the copy the caller waits on finish before writes compete with it
            with self.cond:
                self.cond.wait_for(lambda: bool(self.staged) and self.staged[-1] is None)
        while True:
            with self.cond:
                self.cond.wait_for(lambda: bool(self.staged))
                tensor = self.staged.pop(0)
            if tensor is None:
                if self.stage_failed:
                    raise ZarrckptError(
                        "copying the state to host memory failed on this rank; nothing was committed"
                    ) from self.stage_error
                break
            one = LocalState({tensor.key: [tensor]}, {})
            write_rank(
                self.storage, self.plan, one, rank, self.written, shards=mine.get(tensor.key, []), held_only=True
            )
            _recycle(tensor.data)
            with self.cond:
                self.in_flight -= tensor.data.nbytes
                self.cond.notify_all()


def release_staging() -> None:
    """Free the host staging buffers async_save keeps between saves."""
    with _pool_lock:
        _pool.clear()


def _pool_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.dtype, t.is_pinned())


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy the training loop can no longer change (pinned for GPU tensors)."""
    t = t.detach()
    gpu = t.device.type != "cpu"
    with _pool_lock:
        free = _pool.get((tuple(t.shape), t.dtype, gpu))
        host = free.pop() if free else None
    if host is None:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=gpu)
    host.copy_(t, non_blocking=gpu)
    if gpu:
        torch.cuda.current_stream(t.device).synchronize()
    return host


def _recycle(t: torch.Tensor) -> None:
    with _pool_lock:
        _pool.setdefault(_pool_key(t), []).append(t)
