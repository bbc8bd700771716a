"""async_save(..., staging="background"): returns after planning; the copy runs on a staging thread.

A gate in front of the copy (``hostpool.to_host``) holds staging, so the tests see the call
return before anything is copied without relying on timing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt import asyncsave, hostpool

RAMP = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)  # so no tensor is a constant array (no shards)


def _state(value: float, n: int = 4) -> dict[str, Any]:
    return {"model": {f"w{i}": torch.full((64, 32), value + i) + RAMP for i in range(n)}, "step": int(value)}


def _loaded(url: Path) -> dict[str, Any]:
    got = _state(-1.0)
    zarrckpt.load(got, url)
    return got


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Staging copies wait for this event (set it to let them run)."""
    opened = threading.Event()
    real = hostpool.to_host

    def gated(t: torch.Tensor) -> torch.Tensor:
        assert opened.wait(60), "the test never opened the staging gate"
        return real(t)

    monkeypatch.setattr(hostpool, "to_host", gated)
    yield opened
    opened.set()
    zarrckpt.release_staging()


def test_returns_before_staging_and_mutation_after_wait_staged_cannot_leak(
    tmp_path: Path, gate: threading.Event
) -> None:
    state = _state(1.0)
    future = zarrckpt.async_save(state, tmp_path / "ck", staging="background")
    assert not future.staged.done() and not future.done()  # returned while nothing is copied yet
    gate.set()
    stats = future.wait_staged(timeout=60)
    assert stats.tensors == 4 and stats.peak_bytes == 4 * 64 * 32 * 4
    for t in state["model"].values():  # the optimizer step, after wait_staged()
        t.mul_(0).add_(123.0)
    state["step"] = 99
    future.result(timeout=60)
    got = _loaded(tmp_path / "ck")
    want = _state(1.0)
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"]) and got["step"] == 1


def test_caller_staging_is_done_when_the_call_returns(tmp_path: Path) -> None:
    future = zarrckpt.async_save(_state(2.0), tmp_path / "ck")
    assert future.staged.done() and future.staging.tensors == 4
    future.result(timeout=60)


def _failing_copy(monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    real = hostpool.to_host
    calls = {"n": 0}

    def flaky(t: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == at:
            raise RuntimeError("device copy failed")
        return real(t)

    monkeypatch.setattr(hostpool, "to_host", flaky)


def test_a_staging_failure_fails_both_futures_and_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _failing_copy(monkeypatch, at=3)
    future = zarrckpt.async_save(_state(1.0), tmp_path / "ck", staging="background")
    with pytest.raises(RuntimeError, match="device copy failed"):
        future.wait_staged(timeout=60)
    with pytest.raises(zarrckpt.ZarrckptError, match="nothing was committed") as err:
        future.result(timeout=60)
    assert isinstance(err.value.__cause__, RuntimeError)  # the copy's own error, chained
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.load(_state(0.0), tmp_path / "ck")


def test_manager_wait_staged_raises_a_staging_failure_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = zarrckpt.CheckpointManager(str(tmp_path), interval=1, keep_last=2, staging="background")
    manager.save(1, _state(1.0))
    manager.wait_staged()
    manager.wait()
    _failing_copy(monkeypatch, at=2)
    manager.save(2, _state(2.0))
    with pytest.raises(zarrckpt.CheckpointSaveError, match="step 2") as err:
        manager.wait_staged()
    assert isinstance(err.value.__cause__, RuntimeError)
    monkeypatch.undo()
    manager.save(3, _state(3.0))  # the failure was reported once, by wait_staged()
    manager.wait_staged()
    manager.close()
    assert manager.steps() == [1, 3]


def _mutate_before_staging(
    tmp_path: Path, gate: threading.Event, monkeypatch: pytest.MonkeyPatch, check: bool
) -> Callable[[], None]:
    if check:
        monkeypatch.setenv("ZARRCKPT_CHECK_STAGING", "1")
    state = _state(1.0)
    future = zarrckpt.async_save(state, tmp_path / "ck", staging="background")
    state["model"]["w2"].add_(1000.0)  # an optimizer step before wait_staged(): a bug in the loop
    gate.set()
    return lambda: future.result(timeout=60)


def test_check_staging_catches_a_step_before_wait_staged(
    tmp_path: Path, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    finish = _mutate_before_staging(tmp_path, gate, monkeypatch, check=True)
    with pytest.raises(zarrckpt.ZarrckptError, match="nothing was committed") as err:
        finish()
    assert "'model.w2' changed before it was staged" in str(err.value.__cause__)
    assert "'model.w2' changed before it was staged" in str(err.value), "the save's own error says what was found"
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.load(_state(0.0), tmp_path / "ck")


def test_without_the_check_that_bug_commits_the_changed_tensor(
    tmp_path: Path, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why ZARRCKPT_CHECK_STAGING exists: the same loop bug otherwise goes unnoticed."""
    monkeypatch.delenv("ZARRCKPT_CHECK_STAGING", raising=False)
    _mutate_before_staging(tmp_path, gate, monkeypatch, check=False)()
    assert torch.equal(_loaded(tmp_path / "ck")["model"]["w2"], torch.full((64, 32), 1003.0) + RAMP)


def test_bad_staging_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(zarrckpt.ZarrckptError, match="staging must be 'caller' or 'background'"):
        zarrckpt.async_save(_state(1.0), tmp_path / "ck", staging="later")  # type: ignore[arg-type]


def _small_and_big() -> dict[str, torch.Tensor]:
    return {f"norm{i}": torch.arange(64.0) + i for i in range(3)} | {"big": RAMP.clone()}


def _small_sharded(rank: int, world: int, url: str, check: bool) -> None:
    """Shard(0) norm-like tensors over 2 ranks: their shards are joined (one writer receives the other's part)."""
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if check:
        os.environ["ZARRCKPT_CHECK_STAGING"] = "1"
    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _small_and_big().items()}
    threads: list[str] = []
    real = asyncsave.gather_small

    def spy(*args: Any) -> None:  # records where the exchange runs, then runs it
        threads.append(threading.current_thread().name)
        real(*args)

    asyncsave.gather_small = spy  # type: ignore[assignment]
    try:
        future = zarrckpt.async_save(state, url, staging="background")
        assert not threads or threads[0] != threading.current_thread().name
        future.wait_staged()
        future.result()
    finally:
        asyncsave.gather_small = real  # type: ignore[assignment]
    assert threads and threads[0].startswith("zarrckpt-async"), threads  # the writing thread, not the caller


@pytest.mark.slow
@pytest.mark.parametrize("check", [False, True], ids=["plain", "check-staging"])
def test_background_staging_exchanges_small_tensors_off_the_callers_thread(tmp_path: Path, check: bool) -> None:
    from zarrckpt.testing import spawn

    spawn(2, _small_sharded, str(tmp_path / "ck"), check)
    want = _small_and_big()
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    zarrckpt.load(got, tmp_path / "ck")
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert zarrckpt.open(tmp_path / "ck")["norm0"].meta.shard_shape == (64,)  # joined: one shard, one writer


def _exchange_fails(rank: int, world: int, url: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from zarrckpt.engine import exchange

    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _small_and_big().items()}
    real = exchange._outgoing

    def broken(*args: Any) -> list[bytes]:
        if rank == 1:
            raise zarrckpt.ZarrckptError("a part went missing")  # what a rank lacking its part raises
        return real(*args)

    exchange._outgoing = broken  # type: ignore[assignment]
    try:
        future = zarrckpt.async_save(state, url, staging="background")
        future.wait_staged(timeout=60)  # the copy does not wait forever for an exchange that failed
        with pytest.raises(zarrckpt.ZarrckptError, match=r"a part went missing|failed on rank 1"):
            future.result(timeout=60)
    finally:
        exchange._outgoing = real  # type: ignore[assignment]


@pytest.mark.slow
def test_a_failed_background_exchange_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    from zarrckpt.testing import spawn

    spawn(2, _exchange_fails, str(tmp_path / "ck"))
    assert zarrckpt.list_checkpoints(tmp_path).get("ck") != "committed"  # nothing committed
