"""Staged writes: local tensors copied to host memory within a byte budget, each written as it lands.

Both save paths write device (GPU) tensors this way. :func:`zarrckpt.save` (:func:`write_local`):
when some part this rank writes lives off the CPU, the caller's thread copies those parts to
pinned host buffers (:mod:`zarrckpt.hostpool`), one at a time and never more than the budget
staged-but-unwritten, while a writer thread writes the CPU parts straight from their own memory
and then each staged batch. :func:`zarrckpt.async_save` runs the same copy (:func:`stage`) on the
caller's or a staging thread and the same writer loop (:func:`write_staged`) on its writing thread.

A part is the unit of a copy (its shards are written from it), so a part larger than the budget
is staged alone: staged bytes stay at most ``max(budget, largest part)``.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from zarrckpt import hostpool
from zarrckpt.engine.writer import write_rank
from zarrckpt.errors import ZarrckptError
from zarrckpt.format import integrity
from zarrckpt.format.array import ArrayMeta
from zarrckpt.format.layout import Shape, cell_box
from zarrckpt.plan.localstate import LocalState, LocalTensor
from zarrckpt.plan.save import ZarrSavePlan
from zarrckpt.storage.store import Storage

log = logging.getLogger("zarrckpt")

DEFAULT_SAVE_STAGING_BYTES = 512 * 2**20
"""A sync save's staging budget when neither ``staging_budget_bytes`` nor the environment gives one."""
SAVE_STAGING_ENV = "ZARRCKPT_SAVE_STAGING_BYTES"


def save_budget(explicit: int | None) -> int:
    """A sync save's staging budget: ``explicit``, else ``$ZARRCKPT_SAVE_STAGING_BYTES``, else 512 MiB."""
    if explicit is not None:
        budget = explicit
    else:
        raw = os.environ.get(SAVE_STAGING_ENV, "").strip()
        try:
            budget = int(raw) if raw else DEFAULT_SAVE_STAGING_BYTES
        except ValueError:
            raise ZarrckptError(f"{SAVE_STAGING_ENV}={raw!r}: not a number of bytes") from None
    if budget <= 0:
        raise ZarrckptError(f"save: the staging budget must be a positive number of bytes, not {budget}")
    return budget


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


class HandoffState(enum.Enum):
    """Where the handoff of staged tensors from the stager to the writer stands."""

    STAGING = "staging"  # the stager is copying tensors and putting them in
    STAGED = "staged"  # every tensor was put in; the writer drains the rest
    STAGE_FAILED = "stage failed"  # a copy failed: the writer abandons the save, uncommitted
    ABANDONED = "abandoned"  # the writer failed: the stager stops copying


class Handoff:
    """Staged tensors passed from the stager to the writer, in order, within a byte budget.

    States (:class:`HandoffState`) only move forward: ``STAGING`` -> ``STAGED`` or ``STAGE_FAILED``,
    and from any of them to ``ABANDONED`` when the writer fails. Staged-but-unwritten bytes never
    exceed ``budget`` (a tensor larger than it goes alone). ``what`` names the save in errors.
    """

    def __init__(self, budget: int | None, what: str = "async_save") -> None:
        self.budget = budget
        self.what = what
        self.state = HandoffState.STAGING
        self.error: BaseException | None = None  # what stopped staging (STAGE_FAILED)
        self.in_flight = 0  # staged bytes not yet written
        self.peak = 0
        self._queue: deque[LocalTensor] = deque()
        self._cond = threading.Condition()

    def room_for(self, nbytes: int) -> bool:
        """Stager: block until ``nbytes`` more fit in the budget; False when the writer gave up."""
        with self._cond:
            self._cond.wait_for(lambda: self.state is HandoffState.ABANDONED or self._fits(nbytes))
            return self.state is not HandoffState.ABANDONED

    def _fits(self, nbytes: int) -> bool:
        return self.budget is None or self.in_flight == 0 or self.in_flight + nbytes <= self.budget

    def put(self, tensor: LocalTensor) -> None:
        """Stager: hand one staged tensor to the writer."""
        with self._cond:
            self.in_flight += tensor.data.nbytes
            self.peak = max(self.peak, self.in_flight)
            self._queue.append(tensor)
            self._cond.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        """Stager: every tensor is in (``STAGED``), or ``error`` stopped the copy (``STAGE_FAILED``)."""
        with self._cond:
            if self.state is HandoffState.STAGING:
                self.state = HandoffState.STAGED if error is None else HandoffState.STAGE_FAILED
                self.error = error
            self._cond.notify_all()

    def abandon(self) -> None:
        """Writer: the save failed; the stager stops at its next tensor."""
        with self._cond:
            self.state = HandoffState.ABANDONED
            self._cond.notify_all()

    def wait_staged(self) -> None:
        """Writer: block until staging is over (either way)."""
        with self._cond:
            self._cond.wait_for(lambda: self.state is not HandoffState.STAGING)

    def take(self, max_bytes: int | None = None) -> list[LocalTensor]:
        """Writer: the next staged tensors, in order, as many as are queued up to ``max_bytes`` (at
        least one; None: all queued); an empty list once all were taken.

        Raises:
            ZarrckptError: staging failed on this rank (naming what stopped it); nothing may be committed.
        """
        with self._cond:
            self._cond.wait_for(lambda: bool(self._queue) or self.state is not HandoffState.STAGING)
            if self.state is HandoffState.STAGE_FAILED:
                raise ZarrckptError(
                    f"{self.what}: staging the state in host memory failed on this rank ({self.error}); "
                    "nothing was committed"
                ) from self.error
            batch: list[LocalTensor] = []
            nbytes = 0
            while self._queue and (not batch or max_bytes is None or nbytes + self._queue[0].data.nbytes <= max_bytes):
                batch.append(self._queue.popleft())
                nbytes += batch[-1].data.nbytes
            return batch

    def written(self, nbytes: int) -> None:
        """Writer: tensors of ``nbytes`` (as put in) are written; their bytes leave the budget."""
        with self._cond:
            self.in_flight -= nbytes
            self._cond.notify_all()


def stage(
    handoff: Handoff,
    parts: Iterable[LocalTensor],
    check: Callable[[LocalTensor, torch.Tensor], None] | None = None,
) -> StagingStats:
    """Copy each of ``parts`` to host memory (:func:`zarrckpt.hostpool.to_host`) within the budget and
    hand it to the writer; ``check(part, copy)`` may refuse a copy (raise). Stops early when the writer
    gave up (its error is the save's).

    Raises:
        BaseException: what stopped the copy, after telling the writer (``STAGE_FAILED``).
    """
    start = time.perf_counter()
    copied = 0
    try:
        for tensor in parts:
            if not handoff.room_for(tensor.data.nbytes):
                break  # the writer failed: its error is the save's
            host = hostpool.to_host(tensor.data)
            if check is not None:
                try:
                    check(tensor, host)
                except BaseException:
                    hostpool.recycle(host)
                    raise
            handoff.put(LocalTensor(**{**tensor.__dict__, "data": host}))
            del host  # (the writer frees it: this frame must not hold it while the next copy waits for room)
            copied += 1
    except BaseException as e:
        handoff.finish(e)
        raise
    handoff.finish()
    return StagingStats(copied, time.perf_counter() - start, handoff.peak)


def write_staged(
    storage: Storage,
    plan: ZarrSavePlan,
    handoff: Handoff,
    rank: int,
    written: integrity.Written,
    *,
    keep_bytes: int | None = None,
) -> int:
    """Writer: write the staged tensors' shards as they land, in batches (a batch's shards are written
    concurrently): everything staged without a budget, else up to half of it, so the stager fills the
    other half meanwhile. Each written buffer goes back to the pool (``keep_bytes``: while the pool
    holds less than that). Returns the bytes written."""
    mine: dict[str, list[tuple[ArrayMeta, Shape]]] = {}
    for meta, idx in plan.shards_of(rank):
        mine.setdefault(meta.key, []).append((meta, idx))
    if handoff.budget is None:  # no bound: let the copy the caller waits on finish before writes compete
        handoff.wait_staged()
    most = None if handoff.budget is None else max(1, handoff.budget // 2)
    nbytes = 0
    while batch := handoff.take(most):
        some = LocalState({}, {})
        for tensor in batch:
            some.add(tensor)
        shards = [shard for key in some.tensors for shard in mine.get(key, [])]
        nbytes += write_rank(storage, plan, some, rank, written, shards=shards, held_only=True)
        done = sum(t.data.nbytes for t in batch)
        for tensor in batch:
            hostpool.recycle(tensor.data, keep_bytes=keep_bytes)
        del some, batch, tensor  # a buffer the pool did not keep is freed before the stager copies more
        handoff.written(done)
    return nbytes


def off_cpu(t: torch.Tensor) -> bool:
    """Whether a sync save stages ``t`` (a copy to host memory) rather than writing it from its memory."""
    return t.device.type != "cpu"


def write_local(
    storage: Storage,
    plan: ZarrSavePlan,
    local: LocalState,
    rank: int,
    written: integrity.Written,
    *,
    budget: int,
    moves: Callable[[torch.Tensor], bool] = off_cpu,
) -> int:
    """A sync save's writes of this rank's shards; returns the bytes written.

    All on the CPU: :func:`~zarrckpt.engine.writer.write_rank` straight from the tensors' memory (no
    copy). Otherwise the parts this rank writes that live elsewhere are copied to host memory on the
    caller's thread, within ``budget`` bytes staged but unwritten, while a writer thread writes the CPU
    parts, then each staged batch; a failure on either side stops the other and raises here.
    ``moves`` picks the parts to stage (tests: some or all CPU parts, as device parts would be).
    """
    if not any(moves(p.data) for p in local.parts()):
        return write_rank(storage, plan, local, rank, written)  # nothing to copy
    needed: dict[int, LocalTensor] = {}  # the parts holding this rank's shards, in plan order
    for meta, idx in plan.shards_of(rank):
        cell = cell_box(idx, meta.shard_shape, meta.shape)
        part = local.part_holding(meta.key, cell)
        if part is None:
            raise ZarrckptError(
                f"{meta.key}: this rank (rank {rank}) was to write shard {cell} but holds no part with it"
            )
        needed.setdefault(id(part), part)
    moved = [p for p in needed.values() if moves(p.data)]
    if not moved:  # (the parts off the CPU are none this rank writes)
        return write_rank(storage, plan, local, rank, written)
    direct = LocalState({}, {})
    for part in needed.values():
        if not moves(part.data):
            direct.add(part)
    handoff = Handoff(budget, "save")  # (copies on this thread: ordered after its streams' work, as .cpu() was)
    done: Future[int] = Future()

    def writer() -> None:
        try:
            n = write_rank(storage, plan, direct, rank, written, held_only=True) if direct.tensors else 0
            done.set_result(n + write_staged(storage, plan, handoff, rank, written, keep_bytes=budget))
        except BaseException as e:
            handoff.abandon()
            done.set_exception(e)

    thread = threading.Thread(target=writer, name="zarrckpt-save-writer", daemon=True)
    thread.start()
    try:
        stats = stage(handoff, moved)
    finally:
        thread.join()  # it drains what was staged, or stops at a failed copy: nothing is written after this
    nbytes = done.result()
    log.info(
        "save staged %d parts in %.3fs (peak %d bytes staged, budget %d)",
        stats.tensors,
        stats.seconds,
        stats.peak_bytes,
        budget,
    )
    return nbytes
