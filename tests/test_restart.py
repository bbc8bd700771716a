"""A job killed during a save and restarted carries on by itself: the next save to that location
takes over a save that died (its writer gone from this host, or its pending marker without a
heartbeat for the lease), and never a save that is still running."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt.engine import clock, markers, writerid
from zarrckpt.format.manifest import DELETING, PENDING
from zarrckpt.storage.store import Storage

RAMP = torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16)


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": RAMP + value}, "step": int(value)}


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _died_saving(
    url: Path, *, host: str, pid: int, age: float = 0.0, heartbeat: bool = True, world_size: int | None = None
) -> None:
    """What a save killed half-way leaves: its pending marker and some of its shards. ``host="here"``:
    its writer ran under this kernel and PID namespace (the marker says so), as process ``pid``."""
    storage = Storage(url)
    doc = markers.marker_doc("died", world_size)
    here = {k: v for k, v in writerid.writer_identity().items() if k != "start"}
    doc["writer"] = {**here, "pid": pid} if host == "here" else {"host": host, "pid": pid}
    if not heartbeat:
        del doc["heartbeat"]
    storage.write(PENDING, [json.dumps(doc).encode()])
    storage.write("model/w/c.0.0", [b"half of a shard"])
    if age:
        then = time.time() - age
        for path in (url / PENDING, url / "model/w/c.0.0"):
            os.utime(path, (then, then))


def _loads(url: Path, value: float) -> bool:
    got = _state(-1.0)
    zarrckpt.load(got, url)
    return torch.equal(got["model"]["w"], RAMP + value) and got["step"] == int(value)


def test_a_save_whose_writer_on_this_host_is_gone_is_taken_over(tmp_path: Path) -> None:
    url = tmp_path / "ck"
    _died_saving(url, host="here", pid=_dead_pid())
    zarrckpt.save(_state(2.0), url)
    assert _loads(url, 2.0)


def test_a_pid_under_the_same_hostname_elsewhere_proves_nothing(tmp_path: Path) -> None:
    """Containers and the pods of one job share a hostname: a marker naming this host and a pid that is
    not running here, without this kernel's boot id and PID namespace, may be a live save elsewhere
    (another PID namespace): only its heartbeat decides."""
    url = tmp_path / "ck"
    _died_saving(url, host=socket.gethostname(), pid=_dead_pid())
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="in progress"):
        zarrckpt.save(_state(2.0), url)
    other_ns = {**writerid.writer_identity(), "pid": _dead_pid(), "pidns": "pid:[1]"}
    doc = json.loads((url / PENDING).read_text())
    (url / PENDING).write_text(json.dumps({**doc, "writer": other_ns}))
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="in progress"):
        zarrckpt.save(_state(2.0), url)


def test_a_zombie_or_a_reused_pid_counts_as_gone(tmp_path: Path) -> None:
    """A writer that exited but was never reaped (a zombie) is gone; so is a pid now running another
    process (its start time differs from the marker's)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while (writerid.proc_stat(proc.pid) or ("?", 0))[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (writerid.proc_stat(proc.pid) or ("?", 0))[0] == "Z", "the child is a zombie until reaped"
    zombie = tmp_path / "zombie"
    _died_saving(zombie, host="here", pid=proc.pid)
    zarrckpt.save(_state(2.0), zombie)
    assert _loads(zombie, 2.0)
    proc.wait()
    reused = tmp_path / "reused"
    _died_saving(reused, host="here", pid=os.getpid())  # this very process, but started at another time
    doc = json.loads((reused / PENDING).read_text())
    doc["writer"]["start"] = writerid.writer_identity()["start"] - 1
    (reused / PENDING).write_text(json.dumps(doc))
    zarrckpt.save(_state(3.0), reused)
    assert _loads(reused, 3.0)


def test_a_save_without_a_heartbeat_for_the_lease_is_taken_over(tmp_path: Path) -> None:
    url = tmp_path / "ck"
    _died_saving(url, host="another-host", pid=1, age=markers.lease_seconds() + 1)
    zarrckpt.save(_state(2.0), url)
    assert _loads(url, 2.0)


def test_a_save_with_a_fresh_heartbeat_is_never_touched(tmp_path: Path) -> None:
    url = tmp_path / "ck"
    _died_saving(url, host="another-host", pid=1)
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="in progress"):
        zarrckpt.save(_state(2.0), url)
    assert (url / "model/w/c.0.0").read_bytes() == b"half of a shard", "nothing of it was touched"


def test_a_marker_of_a_zarrckpt_without_heartbeats_keeps_the_grace_period(tmp_path: Path) -> None:
    url = tmp_path / "run" / "step_0000000002"
    _died_saving(url, host="another-host", pid=1, age=markers.lease_seconds() + 1, heartbeat=False)
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="in progress"):
        zarrckpt.save(_state(2.0), url)
    assert zarrckpt.collect_garbage(tmp_path / "run") == []  # younger than the grace period (1 h)


def test_no_wait_for_a_marker_without_heartbeats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its lease never runs out, so waiting for it would only stall the next save (by the lease, 40 s)."""
    from zarrckpt import lifecycle

    url = tmp_path / "step_0000000002"
    _died_saving(url, host="another-host", pid=1, heartbeat=False)

    def no_sleep(seconds: float) -> None:
        raise AssertionError(f"waited {seconds} s for a marker that cannot die by its lease")

    monkeypatch.setattr(clock, "sleep", no_sleep)
    assert lifecycle.await_dead_save(str(url)) is None


def test_gc_collects_a_dead_save_at_once_and_a_live_one_never(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _died_saving(root / "step_0000000001", host="another-host", pid=1, age=markers.lease_seconds() + 1)
    _died_saving(root / "step_0000000002", host="another-host", pid=1)
    removed = zarrckpt.collect_garbage(root)  # the default grace period: an hour
    assert [(e.name, e.died is not None) for e in removed] == [("step_0000000001", True)]
    # the dead save's writers on other ranks may still be writing: its deleting marker stays for a lease
    assert zarrckpt.list_checkpoints(root) == {"step_0000000001": "deleting", "step_0000000002": "incomplete"}
    assert sorted(p.name for p in (root / "step_0000000001").iterdir()) == [DELETING]
    assert zarrckpt.collect_garbage(root) == [], "not before its lease has passed"
    then = time.time() - markers.lease_seconds() - 1
    os.utime(root / "step_0000000001" / DELETING, (then, then))
    assert [e.name for e in zarrckpt.collect_garbage(root)] == ["step_0000000001"]
    assert zarrckpt.list_checkpoints(root) == {"step_0000000002": "incomplete"}


def test_a_one_rank_save_known_to_be_gone_leaves_nothing(tmp_path: Path) -> None:
    """A save of one rank whose process is gone from this host has no writer left: gc removes it whole."""
    root = tmp_path / "run"
    _died_saving(root / "step_0000000001", host="here", pid=_dead_pid(), world_size=1)
    assert [e.name for e in zarrckpt.collect_garbage(root)] == ["step_0000000001"]
    assert zarrckpt.list_checkpoints(root) == {} and not (root / "step_0000000001").exists()


def test_the_manager_waits_for_a_dead_save_to_lose_its_lease_then_takes_it_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart on another host: the killed save's marker is fresh, so the manager's save of that step
    waits until the marker has gone the lease without a heartbeat (here 2 s), then takes it over."""
    monkeypatch.setenv("ZARRCKPT_LEASE_SECONDS", "2")
    root = tmp_path / "run"
    manager = zarrckpt.CheckpointManager(root, interval=1, keep_last=3, async_save=False)
    manager.save(1, _state(1.0))
    _died_saving(Path(manager.url(2)), host="another-host", pid=1)
    began = time.monotonic()
    manager.save(2, _state(2.0))
    assert time.monotonic() - began >= 1.5, "it waited for the lease"
    manager.close()
    assert manager.steps() == [1, 2] and _loads(Path(manager.url(2)), 2.0)


def test_a_running_save_keeps_its_marker_fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a heartbeat every 0.2 s and a lease of 1 s, a save that spends 3 s writing is not taken over
    by a second save to the same location, which is refused; the first one commits."""
    monkeypatch.setattr(markers, "HEARTBEAT_SECONDS", 0.2)
    monkeypatch.setenv("ZARRCKPT_LEASE_SECONDS", "1")
    url = tmp_path / "ck"
    real = Storage.write
    slowed = []

    def slow(self: Storage, path: str, parts: Any, **kwargs: Any) -> None:
        if "/c." in path and not slowed:
            slowed.append(path)
            time.sleep(3)
        real(self, path, parts, **kwargs)

    monkeypatch.setattr(Storage, "write", slow)
    first = zarrckpt.async_save(_state(1.0), url)
    time.sleep(2)  # past the lease: only the heartbeat keeps the marker fresh
    monkeypatch.setattr(Storage, "write", real)
    with pytest.raises(zarrckpt.IncompleteCheckpointError, match="in progress"):
        zarrckpt.save(_state(2.0), url)
    first.result(timeout=60)
    assert slowed and _loads(url, 1.0)


@pytest.mark.parametrize("writer", ["same", "new"])
def test_a_failed_dcp_save_leaves_no_live_heartbeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """A ``dcp.save`` through ``ZarrWriter`` that fails after the prepare (a shard write refused):
    DCP tells the writer nothing, yet the save is abandoned (its heartbeat stopped) when the writer
    is reset for the next save or collected, so the next save to the same place takes it over at
    once; before, the heartbeat beat on until the process exited and every later save was refused
    as "in progress"."""
    import gc

    import torch.distributed.checkpoint as dcp

    url = tmp_path / "ck"
    real = Storage.write

    def refuse(self: Storage, path: str, parts: Any, **kwargs: Any) -> None:
        if "/c." in path:
            raise zarrckpt.StorageError(f"writing {path} refused (injected)")
        real(self, path, parts, **kwargs)

    monkeypatch.setattr(Storage, "write", refuse)
    first = zarrckpt.ZarrWriter(url)
    with pytest.raises(dcp.api.CheckpointException) as failed:
        dcp.save(_state(1.0), storage_writer=first, no_dist=True)
    assert "injected" in str(failed.value.failures)
    del failed  # (its traceback holds the writer)
    monkeypatch.setattr(Storage, "write", real)

    def beating() -> list[tuple[str, str, str]]:  # (heartbeats another test left in this process aside)
        return [key for key in markers._Heartbeat._running if key[0] == str(url)]

    assert beating(), "the failed save's heartbeat is expected to beat until abandoned"
    if writer == "new":
        collected = weakref.ref(first)
        del first
        deadline = time.monotonic() + 10  # (a loaded CI run once found it alive after one collection)
        while gc.collect() is not None and collected() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = collected()
        assert alive is None, f"the writer is still referenced by {[type(r).__name__ for r in gc.get_referrers(alive)]}"
        assert not beating()
    dcp.save(_state(2.0), storage_writer=first if writer == "same" else zarrckpt.ZarrWriter(url), no_dist=True)
    assert not beating() and _loads(url, 2.0)
