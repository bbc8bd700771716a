"""``async_save``: stage to host memory, return, and write in the background.

The caller's thread collects the state, agrees on the plan with the other ranks (so layout
errors raise right away) and copies every local tensor to host memory (pinned when it lives on
a GPU). A background thread prepares the location, writes each tensor's shards as soon as it
is staged, and commits. With a staging budget, staged-but-unwritten bytes never exceed it: the
caller waits for the writer to free room, so a state larger than the budget is partly written
before ``async_save`` returns.

Background collectives use a process group of their own (gloo), created on the first call, so
they never interleave with the training loop's collectives.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as torch_dist

from . import commit as protocol
from . import integrity, replicas, stateful
from .dist import Group
from .errors import ZarrckptError
from .localstate import LocalState, LocalTensor, collect
from .plan import DEFAULT_CHUNK_BYTES, SavePlan, build_save_plan
from .storage import Storage
from .writer import commit_save, write_rank

log = logging.getLogger("zarrckpt")
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zarrckpt-async")
_background_groups: dict[Any, Any] = {}
_last: Future[None] | None = None
_lock = threading.Lock()
# Host staging buffers, kept for the next async_save (no fresh allocation and page faults each
# time); holds at most what one save had staged at once. release_staging() frees them.
_pool: dict[tuple[Any, ...], list[torch.Tensor]] = {}
_pool_lock = threading.Lock()
atexit.register(_executor.shutdown, wait=True)  # a save in flight finishes before the process exits


def async_save(
    state_dict: Any,
    url: Any,
    *,
    storage_options: dict[str, Any] | None = None,
    process_group: Any = None,
    overwrite: bool = False,
    staging_budget_bytes: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    check_replicas: bool = True,
    allow_pickle: bool = False,
) -> Future[None]:
    """Start saving ``state_dict`` to ``url`` and return once it is staged; every rank calls it.

    The returned future completes when the checkpoint is committed, or carries the error. One
    save is in flight at a time: a call first waits for the previous one to finish.
    ``staging_budget_bytes`` bounds the host memory holding staged copies (default: no bound).
    ``overwrite``, ``check_replicas`` and ``allow_pickle`` are as for :func:`zarrckpt.save`; layout and replica
    problems raise here, before the call returns.
    """
    global _last
    with _lock:
        if _last is not None:
            wait_for([_last])
        group = Group(process_group)
        resolved, _ = stateful.resolve(state_dict)
        local = group.run_together(lambda: collect(resolved, allow_pickle), "collecting the state dict")
        plan = build_save_plan(group.all_gather_json(local.describe()), chunk_bytes)
        if check_replicas:
            replicas.check(group, plan, local)
        background = Group(_background_group(process_group)) if group.active else group
        job = _Job(Storage(url, storage_options), plan, background, overwrite, staging_budget_bytes)
        future = _executor.submit(job.run)
        _last = future
        job.stage(local)
        return future


def _background_group(process_group: Any) -> Any:
    """A gloo group over the same ranks, for the background thread's collectives (created once)."""
    key = id(process_group)
    if key not in _background_groups:
        ranks = torch_dist.get_process_group_ranks(process_group) if process_group is not None else None
        _background_groups[key] = torch_dist.new_group(ranks=ranks, backend="gloo")
    return _background_groups[key]


@dataclass
class _Job:
    storage: Storage
    plan: SavePlan
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

    def stage(self, local: LocalState) -> None:
        """Caller's thread: copy each local tensor to host memory, within the budget.

        If staging fails, the background save is told so and abandons the checkpoint uncommitted.
        """
        try:
            self._stage(local)
        except BaseException:
            with self.cond:
                self.stage_failed = True
                self.staged.append(None)
                self.cond.notify_all()
            raise

    def _stage(self, local: LocalState) -> None:
        start = time.perf_counter()
        for tensor in local.tensors.values():
            nbytes = tensor.data.nbytes
            with self.cond:
                self.cond.wait_for(partial(self._ready_for, nbytes))
                if self.failed:
                    return
            host = _to_host(tensor.data)
            with self.cond:
                self.in_flight += nbytes
                self.peak = max(self.peak, self.in_flight)
                self.staged.append(LocalTensor(**{**tensor.__dict__, "data": host}))
                self.cond.notify_all()
        with self.cond:
            self.staged.append(None)
            self.cond.notify_all()
        log.info(
            "async save staged %d tensors in %.3fs, peak %d bytes staged",
            len(local.tensors),
            time.perf_counter() - start,
            self.peak,
        )

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
        if self.budget is None:  # no bound: let the copy the caller waits on finish before writes compete with it
            with self.cond:
                self.cond.wait_for(lambda: bool(self.staged) and self.staged[-1] is None)
        while True:
            with self.cond:
                self.cond.wait_for(lambda: bool(self.staged))
                tensor = self.staged.pop(0)
            if tensor is None:
                if self.stage_failed:
                    raise ZarrckptError("copying the state to host memory failed on this rank; nothing was committed")
                break
            one = LocalState({tensor.key: tensor}, {}, {})
            write_rank(self.storage, self.plan, one, rank, {tensor.key}, self.written)
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
