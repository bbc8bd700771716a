"""async_save and CheckpointManager."""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from states import check_loaded, mixed_state

import zarrckpt
from zarrckpt.engine import markers
from zarrckpt.testing import spawn

RAMP = torch.arange(128 * 64, dtype=torch.float32).reshape(128, 64)  # so no tensor is a constant array (no shards)


def _state(value: float, n: int = 6) -> dict[str, Any]:
    return {"model": {f"w{i}": torch.full((128, 64), value + i) + RAMP for i in range(n)}, "step": int(value)}


def _assert_loads(url: str, value: float, **kw: Any) -> None:
    got = _state(-1.0)
    zarrckpt.load(got, url, **kw)
    want = _state(value)
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"]) and got["step"] == want["step"]


def test_async_save_stages_then_training_may_continue(tmp_path: Path) -> None:
    state = _state(1.0)
    future = zarrckpt.async_save(state, str(tmp_path / "ck"))
    for t in state["model"].values():  # the training loop changes the weights right away
        t.add_(100.0)
    assert future.result(timeout=60) is None
    # without a budget the writes wait for the whole copy: everything was staged at once
    assert future.staging.tensors == 6 and future.staging.peak_bytes == 6 * 128 * 64 * 4, future.staging
    _assert_loads(str(tmp_path / "ck"), 1.0)
    from zarrckpt import hostpool

    assert hostpool.pool, "staging buffers are kept for the next save"
    zarrckpt.release_staging()
    assert not hostpool.pool


def test_staging_budget_bounds_host_copies(tmp_path: Path) -> None:
    budget = 2 * 128 * 64 * 4  # two of the six tensors
    future = zarrckpt.async_save(_state(3.0), str(tmp_path / "ck"), staging_budget_bytes=budget)
    stats = future.staging  # known as soon as the call returns
    future.result(timeout=60)
    assert stats.tensors == 6 and stats.seconds >= 0, stats
    assert 0 < stats.peak_bytes <= budget, stats
    _assert_loads(str(tmp_path / "ck"), 3.0)


def test_failure_surfaces_through_the_future(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    zarrckpt.save(_state(1.0), url)
    future = zarrckpt.async_save(_state(2.0), url)
    with pytest.raises(zarrckpt.CheckpointExistsError):
        future.result(timeout=60)
    _assert_loads(url, 1.0)


def test_layout_errors_raise_at_the_call(tmp_path: Path) -> None:
    with pytest.raises(zarrckpt.errors.InvalidKeyError):
        zarrckpt.async_save({"a..b": torch.zeros(1)}, str(tmp_path / "ck"))


def test_one_save_in_flight(tmp_path: Path) -> None:
    first = zarrckpt.async_save(_state(1.0, n=20), str(tmp_path / "a"))
    second = zarrckpt.async_save(_state(2.0), str(tmp_path / "b"))
    assert first.done(), "the second call waits for the first save to finish"
    second.result(timeout=60)
    _assert_loads(str(tmp_path / "b"), 2.0)


def _async_ranks(rank: int, world: int, url: str) -> None:
    future = zarrckpt.async_save(mixed_state(rank, world, fill=True, save_world=world), url, staging_budget_bytes=512)
    future.result(timeout=120)


def _load_ranks(rank: int, world: int, url: str) -> None:
    state = mixed_state(rank, world, fill=False, save_world=4)
    zarrckpt.load(state, url)
    check_loaded(state, rank, world, 4)


@pytest.mark.slow
def test_async_save_multi_rank(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    spawn(4, _async_ranks, url)
    spawn(3, _load_ranks, url)


def test_manager_retention_and_resume(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    manager = zarrckpt.CheckpointManager(root, interval=2, keep_last=2, keep_every=4)
    for step in range(11):
        manager.save(step, _state(float(step)))
    manager.wait()
    assert manager.steps() == [0, 4, 8, 10]
    assert manager.latest() == 10
    target = _state(-1.0)
    assert manager.load_latest(target) == 10
    assert torch.equal(target["model"]["w0"], torch.full((128, 64), 10.0) + RAMP)
    manager.close()


def test_close_right_after_the_last_save_still_applies_retention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last save's clean-up is queued with the save, so close() cannot finish before it.

    Future callbacks run after waiters wake; a scheduling delay there (forced here) used to let
    close() return, and shut the deletion pool, before the clean-up was queued.
    """
    invoke = concurrent.futures.Future._invoke_callbacks  # type: ignore[attr-defined]

    def late(self: concurrent.futures.Future) -> None:
        time.sleep(0.2)
        invoke(self)

    monkeypatch.setattr(concurrent.futures.Future, "_invoke_callbacks", late)
    for attempt in range(2):
        manager = zarrckpt.CheckpointManager(str(tmp_path / f"run{attempt}"), interval=1, keep_last=1)
        for step in range(3):
            manager.save(step, _state(float(step)))
        manager.close()
        assert manager.steps() == [2]


def test_manager_removes_uncommitted_leftovers(tmp_path: Path) -> None:
    root = tmp_path / "run"
    manager = zarrckpt.CheckpointManager(str(root), interval=1, keep_last=5, async_save=False)
    manager.save(1, _state(1.0))
    for step in (3, 9):  # saves that died before committing (3), or may still be running (9)
        (root / f"step_{step:010d}").mkdir(parents=True)
        (root / f"step_{step:010d}" / ".zarrckpt-pending.json").write_text("{}")
    dead = time.time() - markers.lease_seconds() - 1  # (no heartbeat for the lease)
    os.utime(root / "step_0000000003" / ".zarrckpt-pending.json", (dead, dead))
    manager.save(5, _state(5.0))
    manager.wait()
    assert not (root / "step_0000000003").exists(), "the leftover of a save that died is removed"
    assert (root / "step_0000000009").exists(), "a save that may still be running is kept, older or not"
    assert manager.steps() == [1, 5] and manager.latest() == 5
    assert zarrckpt.list_checkpoints(str(root))["step_0000000009"] == "incomplete"
    manager.close()


def test_two_managers_same_step(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    first = zarrckpt.CheckpointManager(root, interval=10, keep_last=3)
    second = zarrckpt.CheckpointManager(root, interval=10, keep_last=3)
    first.save(10, _state(1.0)).result(timeout=60)
    with pytest.raises(zarrckpt.CheckpointExistsError, match="already exists"):
        second.save(10, _state(2.0)).result(timeout=60)
    with pytest.raises(zarrckpt.CheckpointSaveError, match="step 10") as err:  # the manager reports it too
        second.save(15, _state(2.0))
    assert isinstance(err.value.__cause__, zarrckpt.CheckpointExistsError)
    # a save of that step still in progress (its pending marker is there): refused as well
    (tmp_path / "run" / "step_0000000020").mkdir()
    (tmp_path / "run" / "step_0000000020" / ".zarrckpt-pending.json").write_text('{"save_id": "x"}')
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="in progress"):
        second.save(20, _state(2.0)).result(timeout=60)
    _assert_loads(first.url(10), 1.0)
    first.close()
    with pytest.raises(zarrckpt.CheckpointSaveError, match="step 20"):  # close() raises the last failure
        second.close()


def test_manager_on_s3(s3_url: tuple[str, dict[str, Any]]) -> None:
    url, opts = s3_url
    manager = zarrckpt.CheckpointManager(url, interval=1, keep_last=1, storage_options=opts)
    for step in range(3):
        manager.save(step, _state(float(step)))
    manager.wait()
    assert manager.steps() == [2]
    _assert_loads(manager.url(2), 2.0, storage_options=opts)
    manager.close()


def test_staging_failure_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zarrckpt import hostpool

    calls = {"n": 0}
    real = hostpool.to_host

    def flaky(t: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device copy failed")
        return real(t)

    monkeypatch.setattr(hostpool, "to_host", flaky)
    with pytest.raises(RuntimeError, match="device copy failed"):
        zarrckpt.async_save(_state(1.0), str(tmp_path / "ck"))
    monkeypatch.setattr(hostpool, "to_host", real)
    future = zarrckpt.async_save(_state(2.0), str(tmp_path / "other"))  # waits for the abandoned one
    future.result(timeout=60)
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.load(_state(0.0), str(tmp_path / "ck"))


def _first_save_makes_no_group(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    made = []
    real = dist.new_group
    dist.new_group = lambda *a, **k: made.append(1) or real(*a, **k)  # a spy: counts, then does the real thing
    try:
        manager = zarrckpt.CheckpointManager(root, interval=1, keep_last=2)
        assert len(made) == 1, made  # the background saves' process group: made here, collectively
        future = manager.save(1, _state(3.0))
        assert future is not None
        future.result()
        manager.close()
        assert len(made) == 1, made  # the first save made none
    finally:
        dist.new_group = real


@pytest.mark.slow
def test_manager_construction_pays_for_the_first_async_save(tmp_path: Path) -> None:
    """The process group of background saves is made when the manager is, not in the first save
    (a collective of a second or more at scale, which would block the training loop there)."""
    spawn(2, _first_save_makes_no_group, str(tmp_path / "run"))
    _assert_loads(str(tmp_path / "run" / "step_0000000001"), 3.0)


FIRST_CALLS = """
import sys, torch
from zarrckpt import async_save, load
state = {"w": torch.arange(6.0), "step": 1}
async_save(state, sys.argv[1], staging="background").result()
load(state, sys.argv[1])
print(sorted(m for m in ("torch.distributed.tensor", "sympy") if m in sys.modules))
"""


def test_plain_tensors_never_import_dtensor(tmp_path: Path) -> None:
    """A state of plain tensors has no DTensor to look for: the first save does not import its module
    (most of a second, sympy included, blocking the caller of the first async_save)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", FIRST_CALLS, str(tmp_path / "ck")], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
