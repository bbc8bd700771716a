"""A deletion killed half-way (retention's, or `zarrckpt rm`'s) does not block the next save there:
a restarted job that saves that step again finishes the dead deletion and commits, while a deletion
that is still running (its writer alive on this host, or its marker kept fresh by a heartbeat) is
never taken for a dead one. Found by benchmarks/restart_trials.py: a job killed while retention
deleted an incomplete step failed, after its restart, to save that step again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt.engine import markers, writerid
from zarrckpt.format.manifest import DELETING, MANIFEST, tombstone
from zarrckpt.storage.store import Storage

RAMP = torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16)


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": RAMP + value}, "step": int(value)}


def _loads(url: Path, value: float) -> bool:
    got = _state(-1.0)
    zarrckpt.load(got, url)
    return torch.equal(got["model"]["w"], RAMP + value) and got["step"] == int(value)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _died_deleting(url: Path, *, host: str, pid: int, age: float = 0.0, marker: bool = True) -> None:
    """What a deletion killed half-way leaves of a committed checkpoint: the tombstone, the deleting
    marker (``marker=False``: a zarrckpt that wrote the tombstone first, killed between the two) and
    the objects not deleted yet. ``host="here"``: its writer ran under this kernel and PID namespace."""
    zarrckpt.save(_state(1.0), url)
    storage = Storage(url)
    doc = markers.marker_doc(zarrckpt.open(url).manifest.save_id)
    here = {k: v for k, v in writerid.writer_identity().items() if k != "start"}
    doc["writer"] = {**here, "pid": pid} if host == "here" else {"host": host, "pid": pid}
    storage.write(MANIFEST, [tombstone(doc)])
    written = [url / MANIFEST]
    if marker:
        storage.write(DELETING, [json.dumps(doc).encode()])
        written.append(url / DELETING)
    if age:
        then = time.time() - age
        for path in written:
            os.utime(path, (then, then))


@pytest.mark.parametrize("marker", [True, False], ids=["marker", "tombstone-only"])
def test_a_deletion_whose_writer_on_this_host_is_gone_is_finished_by_the_next_save(
    tmp_path: Path, marker: bool
) -> None:
    url = tmp_path / "ck"
    _died_deleting(url, host="here", pid=_dead_pid(), marker=marker)
    zarrckpt.save(_state(2.0), url)
    assert _loads(url, 2.0)


def test_a_deletion_without_a_heartbeat_for_the_lease_is_finished(tmp_path: Path) -> None:
    url = tmp_path / "ck"
    _died_deleting(url, host="another-host", pid=1, age=markers.lease_seconds() + 1)
    zarrckpt.save(_state(2.0), url)
    assert _loads(url, 2.0)


@pytest.mark.parametrize("marker", [True, False], ids=["marker", "tombstone-only"])
def test_a_deletion_that_may_still_run_is_never_touched(tmp_path: Path, marker: bool) -> None:
    url = tmp_path / "ck"
    _died_deleting(url, host="another-host", pid=1, marker=marker)
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="is being deleted"):
        zarrckpt.save(_state(2.0), url)
    assert (url / "model" / "w" / "zarr.json").exists(), "nothing of it was touched"


def test_a_restarted_manager_saves_a_step_whose_deletion_died(tmp_path: Path) -> None:
    """The trial's case: step 2 (incomplete) was being deleted by retention when the job was killed;
    the restarted job resumes from step 1 and saves step 2 again, with no manual step."""
    root = tmp_path / "run"
    manager = zarrckpt.CheckpointManager(root, interval=1, keep_last=2, async_save=False)
    manager.save(1, _state(1.0))
    manager.close()
    _died_deleting(Path(manager.url(2)), host="here", pid=_dead_pid())
    restarted = zarrckpt.CheckpointManager(root, interval=1, keep_last=2)
    got = _state(-1.0)
    assert restarted.load_latest(got) == 1
    restarted.save(2, _state(2.0))
    restarted.close()
    assert restarted.steps() == [1, 2] and _loads(Path(restarted.url(2)), 2.0)
    assert zarrckpt.list_checkpoints(root) == {"step_0000000001": "committed", "step_0000000002": "committed"}


def test_a_running_deletion_keeps_its_marker_fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a heartbeat every 0.2 s and a lease of 1 s, a deletion that spends 3 s deleting is not taken
    for a dead one by a save to the same location, which is refused; the deletion ends."""
    monkeypatch.setattr(markers, "HEARTBEAT_SECONDS", 0.2)
    monkeypatch.setenv("ZARRCKPT_LEASE_SECONDS", "1")
    url = tmp_path / "ck"
    zarrckpt.save(_state(1.0), url)
    real = Storage.delete_all
    entered = threading.Event()

    def slow(self: Storage, **kwargs: Any) -> None:
        entered.set()
        time.sleep(3)
        real(self, **kwargs)

    monkeypatch.setattr(Storage, "delete_all", slow)
    deleting = threading.Thread(target=zarrckpt.delete, args=(url,))
    deleting.start()
    assert entered.wait(10)
    time.sleep(2)  # past the lease: only the heartbeat keeps the marker fresh
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="is being deleted"):
        zarrckpt.save(_state(2.0), url)
    deleting.join(30)
    assert not url.exists() or not any(url.iterdir())
    zarrckpt.save(_state(2.0), url)
    assert _loads(url, 2.0)
