"""CheckpointManager's retention by a metric (issue 41): ``keep_best`` keeps the best checkpoints by a
metric saved with each one, besides the ``keep_last`` newest; a restarted manager reads the old
checkpoints' metrics from their manifests. Real saves on local disk."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt.lifecycle import read_head
from zarrckpt.retention import Policy, metrics_of
from zarrckpt.testing import spawn

LOSS = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.2, 5: 0.8, 6: 0.7, 7: 0.6, 8: 0.95}  # best (min): 4, 2, 3


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((8, 4), float(step)), "step": step}


def _run(root: Path, steps: range, **kwargs: Any) -> list[int]:
    manager = zarrckpt.CheckpointManager(root, interval=1, keep_last=2, keep_best=2, best_metric="val/loss", **kwargs)
    try:
        for step in steps:
            manager.save(step, _state(step), metrics={"val/loss": LOSS[step], "acc": torch.tensor(1.0 - LOSS[step])})
    finally:
        manager.close()
    return zarrckpt.committed_steps(root)


@pytest.mark.parametrize("use_async", [True, False])
def test_keep_best_keeps_the_best_and_the_newest(tmp_path: Path, use_async: bool) -> None:
    assert _run(tmp_path, range(1, 8), async_save=use_async) == [2, 4, 6, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step_{s:010d}" for s in (2, 4, 6, 7)]


def test_best_mode_max(tmp_path: Path) -> None:
    assert _run(tmp_path, range(1, 8), best_mode="max") == [1, 5, 6, 7]  # the highest losses: 0.9, 0.8


def test_the_metrics_are_saved_in_the_checkpoint_and_a_strict_load_ignores_them(tmp_path: Path) -> None:
    _run(tmp_path, range(1, 3))
    url = f"{tmp_path}/step_0000000002"
    assert metrics_of(read_head(url).values) == {"val/loss": 0.3, "acc": pytest.approx(0.7)}
    assert zarrckpt.open(url).metadata["zarrckpt_manager"]["metrics"][0] == ["val/loss", 0.3]
    got = _state(0)
    zarrckpt.load(got, url)  # strict: the manager's entry is no unexpected key
    assert got["step"] == 2


def test_a_restarted_manager_ranks_the_old_checkpoints_by_their_saved_metrics(tmp_path: Path) -> None:
    assert _run(tmp_path, range(1, 5)) == [2, 3, 4]  # 3: among the 2 newest
    # a new manager on the same root knows none of them: it reads their manifests' heads
    assert _run(tmp_path, range(5, 9)) == [2, 4, 7, 8]


def test_checkpoints_without_the_metric_are_kept_while_newest_then_deleted_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = zarrckpt.CheckpointManager(tmp_path, interval=1, keep_last=2, keep_best=1, best_metric="loss")
    try:
        manager.save(1, _state(1), metrics={"loss": 0.1})
        manager.save(2, _state(2))  # no metrics
        manager.save(3, _state(3), metrics={"loss": float("nan")})  # not ranked either
        manager.wait()
        assert manager.steps() == [1, 2, 3]
        with caplog.at_level(logging.WARNING, logger="zarrckpt"):
            manager.save(4, _state(4), metrics={"other": 0.0})
            manager.save(5, _state(5), metrics={"loss": 0.5})
            manager.wait()
    finally:
        manager.close()
    assert zarrckpt.committed_steps(tmp_path) == [1, 4, 5]
    said = [r.getMessage() for r in caplog.records if "keep_best does not rank" in r.getMessage()]
    assert [m.split()[2] for m in said] == ["2", "3"]
    assert all("'loss'" in m for m in said)


def test_a_step_still_being_deleted_is_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention after the next save finds an unranked step whose deletion is still running: it is
    not queued again (``_doomed``), and now not warned about again either (a loaded CI run logged
    step 2 twice)."""
    import threading
    import time

    import zarrckpt.deleter

    entered, release = threading.Event(), threading.Event()
    real = zarrckpt.deleter.delete

    def slow(*args: Any, **kwargs: Any) -> None:
        entered.set()
        release.wait(60)
        real(*args, **kwargs)

    monkeypatch.setattr(zarrckpt.deleter, "delete", slow)

    def said() -> list[str]:  # the steps warned about
        return [r.getMessage().split()[2] for r in caplog.records if "keep_best does not rank" in r.getMessage()]

    manager = zarrckpt.CheckpointManager(tmp_path, interval=1, keep_last=1, keep_best=1, best_metric="loss")
    try:
        with caplog.at_level(logging.WARNING, logger="zarrckpt"):
            manager.save(1, _state(1), metrics={"loss": 0.1})
            manager.save(2, _state(2))
            manager.save(3, _state(3))  # its retention deletes step 2, which blocks
            assert entered.wait(60)
            manager.save(4, _state(4))  # its retention finds step 2 still listed, and deletes step 3
            deadline = time.monotonic() + 60
            while "3" not in said() and time.monotonic() < deadline:
                time.sleep(0.05)
            release.set()
            manager.wait()
    finally:
        release.set()
        manager.close()
    assert said() == ["2", "3"]
    assert zarrckpt.committed_steps(tmp_path) == [1, 4]


def test_without_keep_best_retention_is_unchanged_and_metrics_are_still_saved(tmp_path: Path) -> None:
    manager = zarrckpt.CheckpointManager(tmp_path, interval=1, keep_last=2)
    try:
        for step in range(1, 5):
            manager.save(step, _state(step), metrics={"loss": LOSS[step]})
    finally:
        manager.close()
    assert zarrckpt.committed_steps(tmp_path) == [3, 4]
    assert metrics_of(read_head(f"{tmp_path}/step_0000000004").values) == {"loss": 0.2}


def test_a_checkpoint_whose_manifest_cannot_be_read_is_kept() -> None:
    policy = Policy(keep_last=1, keep_best=1, best_metric="m")
    assert policy.keep([1, 2, 3, 4], {1: 0.5, 3: None, 4: 0.9}) == {1, 2, 4}  # 2: unread; 3: no metric


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"keep_best": 0, "best_metric": "m"}, "keep_best must be >= 1"),
        ({"keep_best": 2}, "comes with best_metric"),
        ({"keep_best": 2, "best_metric": "m", "best_mode": "lowest"}, "best_mode must be 'min' or 'max'"),
    ],
)
def test_bad_policies_are_refused(tmp_path: Path, kwargs: dict[str, Any], why: str) -> None:
    with pytest.raises(zarrckpt.ZarrckptError, match=why):
        zarrckpt.CheckpointManager(tmp_path, interval=1, keep_last=1, **kwargs)


def test_bad_metrics_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    manager = zarrckpt.CheckpointManager(tmp_path, interval=1, keep_last=1, async_save=False)
    try:
        with pytest.raises(zarrckpt.ZarrckptError, match="'loss' is not a number"):
            manager.save(1, _state(1), metrics={"loss": "low"})
        with pytest.raises(zarrckpt.ZarrckptError, match="has a 'zarrckpt_manager' entry"):
            manager.save(2, {**_state(2), "zarrckpt_manager": 1}, metrics={"loss": 0.1})
    finally:
        manager.close()
    assert list(tmp_path.iterdir()) == []


def _ranks(rank: int, world: int, root: str) -> None:
    manager = zarrckpt.CheckpointManager(root, interval=1, keep_last=1, keep_best=1, best_metric="loss")
    try:
        for step in range(1, 4):  # each rank its own loss (rank 0's is saved and ranked); rank 1 passes none at 2
            metrics = None if (rank, step) == (1, 2) else {"loss": LOSS[step] + rank}
            manager.save(step, _state(step), metrics=metrics)
    finally:
        manager.close()


def test_ranks_passing_different_metrics_save_rank_0s(tmp_path: Path) -> None:
    spawn(2, _ranks, str(tmp_path))
    assert zarrckpt.committed_steps(tmp_path) == [2, 3]  # 2: the lowest loss (0.3), 3: the newest
    assert metrics_of(read_head(f"{tmp_path}/step_0000000002").values) == {"loss": 0.3}
