"""Preemption is a save: with ``CheckpointManager(..., save_on=(signal.SIGTERM, ...))`` a signal makes
the next ``save()`` call save the step it is at (after the save in flight), on every rank alike;
then ``preempted`` tells the loop to stop. Real signals, and a real torchrun job killed the way a
scheduler does it (SIGTERM to torchrun, which forwards it to its ranks); and ``zarrckpt latest``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt.cli import main as cli
from zarrckpt.testing.procs import free_port


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((64, 16), float(step)), "step": step}


def test_a_signal_saves_the_next_step_and_says_stop(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    manager = zarrckpt.CheckpointManager(tmp_path, interval=10, keep_last=2, save_on=(signal.SIGUSR1,))
    assert signal.getsignal(signal.SIGUSR1) is not before
    for step in range(1, 3):
        assert manager.save(step, _state(step)) is None  # not due
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)  # a second one changes nothing
    assert manager.save(3, _state(3)) is not None
    assert manager.preempted == signal.SIGUSR1
    assert manager.steps() == [3] and zarrckpt.latest_step(tmp_path) == 3
    with pytest.raises(zarrckpt.ZarrckptError, match=r"preempted .*stop training"):
        manager.save(4, _state(4))
    manager.close()
    assert signal.getsignal(signal.SIGUSR1) is before, "close() puts the previous handler back"
    got = _state(0)
    zarrckpt.load(got, manager.url(3))
    assert got["step"] == 3 and torch.equal(got["w"], _state(3)["w"])


def test_a_signal_during_an_async_save_waits_for_it_then_saves(tmp_path: Path) -> None:
    manager = zarrckpt.CheckpointManager(tmp_path, interval=2, keep_last=5, save_on=(signal.SIGUSR1,))
    try:
        future = manager.save(2, _state(2))  # due: async, in flight
        assert future is not None
        os.kill(os.getpid(), signal.SIGUSR1)
        manager.save(3, _state(3))
        assert future.done() and future.exception() is None
        assert manager.preempted == signal.SIGUSR1 and manager.steps() == [2, 3]
    finally:
        manager.close()


def test_the_preemption_save_applies_retention(tmp_path: Path) -> None:
    """A preempted job exits holding keep_last checkpoints, not keep_last + 1 (issue 41)."""
    manager = zarrckpt.CheckpointManager(tmp_path, interval=2, keep_last=2, save_on=(signal.SIGUSR1,))
    try:
        for step in range(1, 6):
            manager.save(step, _state(step))
        manager.wait()
        assert manager.steps() == [2, 4]
        os.kill(os.getpid(), signal.SIGUSR1)
        manager.save(5, _state(5))  # not due: saved because preempted
        assert manager.preempted == signal.SIGUSR1
    finally:
        manager.close()
    assert zarrckpt.committed_steps(tmp_path) == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000000004", "step_0000000005"]


def test_without_save_on_a_signal_is_not_caught(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    zarrckpt.CheckpointManager(tmp_path, interval=1, keep_last=1).close()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_save_on_outside_the_main_thread_is_refused(tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def make() -> None:
        try:
            zarrckpt.CheckpointManager(tmp_path, interval=1, keep_last=1, save_on=(signal.SIGUSR1,))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], zarrckpt.ZarrckptError) and "main thread" in str(errors[0])


def test_latest_names_only_committed_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "run"
    assert cli(["latest", str(root)]) == 1 and "no committed checkpoint" in capsys.readouterr().err
    for step in (1, 2):
        zarrckpt.save(_state(step), root / f"step_{step:010d}")
    (root / "step_0000000003").mkdir()
    (root / "step_0000000003" / ".zarrckpt-pending.json").write_text("{}")  # a save of step 3 under way
    zarrckpt.save(_state(9), root / "not_a_step")
    assert cli(["latest", str(root)]) == 0 and capsys.readouterr().out == "2\n"
    assert cli(["latest", str(root), "--url"]) == 0 and capsys.readouterr().out == f"{root}/step_0000000002\n"
    assert cli(["latest", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"root": str(root), "step": 2, "url": f"{root}/step_0000000002"}
    assert zarrckpt.committed_steps(root) == [1, 2]


def _torchrun(root: Path, steps: int, save_every: int) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    args += ["-m", "zarrckpt.example.train", "--ckpt", str(root), "--steps", str(steps)]
    args += ["--save-every", str(save_every), "--log-every", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("save_every", [1, 1000], ids=["async-save-in-flight", "no-save-due"])
def test_sigterm_to_torchrun_saves_the_step_and_the_restart_resumes_there(tmp_path: Path, save_every: int) -> None:
    """SIGTERM to torchrun (as Kubernetes or Slurm stop a job) after a few steps: both ranks save the
    step they are at (after the async save in flight, with a save every step) and exit with 143
    (torchrun then fails); the next run resumes from exactly that step."""
    root = tmp_path / "run"
    job = _torchrun(root, 400, save_every)
    assert job.stdout is not None
    lines: list[str] = []
    for line in job.stdout:
        lines.append(line.rstrip("\n"))
        if re.match(r"step 4 loss", line):
            job.send_signal(signal.SIGTERM)
            break
    rest, _ = job.communicate(timeout=120)
    out = "\n".join([*lines, rest])
    assert job.returncode != 0, "a preempted job does not report success (its scheduler restarts it)"
    found = re.search(r"preempted \(SIGTERM\): saved step (\d+), exiting", out)
    assert found, out[-3000:]
    step = int(found.group(1))
    assert step >= 4 and zarrckpt.latest_step(root) == step, (step, zarrckpt.list_checkpoints(root))
    assert "incomplete" not in zarrckpt.list_checkpoints(root).values()
    started = time.monotonic()
    resumed = _torchrun(root, step + 2, save_every)
    out, _ = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, out[-3000:]
    assert f"resumed from step {step} of" in out and f"done: step {step + 2}" in out, out[-3000:]
    assert time.monotonic() - started < 180
