"""Local saves write objects straight to their names and make them durable with one barrier before the
commit record (zarrckpt/storage/durable.py): the barrier covers every object, comes before the commit,
is never retried when the sync itself fails, and a write that fails half-way leaves no torn object."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import zarrckpt
from zarrckpt.engine import commit
from zarrckpt.format.manifest import MANIFEST
from zarrckpt.storage import durable
from zarrckpt.storage.store import Storage


def _state() -> dict[str, Any]:
    return {
        "model": {
            f"l{i}": {"w": torch.arange(300.0).reshape(20, 15) + i, "b": torch.full((5,), float(i))} for i in range(6)
        },
        "big": torch.randn(600, 700, generator=torch.Generator().manual_seed(3)),
        "step": 7,
    }


def _same(url: Path, want: dict[str, Any]) -> None:
    got = {"model": {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in want["model"].items()}}
    got |= {"big": torch.zeros_like(want["big"]), "step": 0}
    zarrckpt.load(got, str(url))
    assert got["step"] == want["step"] and torch.equal(got["big"], want["big"])
    assert all(torch.equal(got["model"][k][n], t) for k, v in want["model"].items() for n, t in v.items())


def _track_commit(monkeypatch: pytest.MonkeyPatch, events: list[str]) -> None:
    real = Storage.create

    def create(self: Storage, path: str, parts: Any, **kwargs: Any) -> None:
        if path == MANIFEST:
            events.append("commit")
        real(self, path, parts, **kwargs)

    monkeypatch.setattr(Storage, "create", create)


def _objects(url: Path) -> set[str]:
    """The shard and zarr.json files a save wrote (not the commit record or markers)."""
    return {
        str(p) for p in url.rglob("*") if p.is_file() and not p.name.startswith(".zarrckpt") and p != url / MANIFEST
    }


def test_syncfs_once_before_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if durable._syncfs_call() is None:
        pytest.skip("no syncfs in this C library")
    monkeypatch.delenv("ZARRCKPT_LOCAL_SYNC", raising=False)
    events: list[str] = []
    real = durable._syncfs
    monkeypatch.setattr(durable, "_syncfs", lambda path: (events.append("sync"), real(path))[1])
    _track_commit(monkeypatch, events)
    url = tmp_path / "ck"
    zarrckpt.save(_state(), str(url))
    assert events == ["sync", "commit"], events
    _same(url, _state())


def test_files_mode_syncs_every_object_and_directory_before_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZARRCKPT_LOCAL_SYNC", "files")
    events: list[str] = []
    synced: dict[str, bool] = {}
    real = durable.sync_path

    def sync_path(path: str, data_only: bool) -> None:
        synced[path] = data_only
        events.append("sync")
        real(path, data_only)

    monkeypatch.setattr(durable, "sync_path", sync_path)
    _track_commit(monkeypatch, events)
    url = tmp_path / "ck"
    zarrckpt.save(_state(), str(url))
    objects = _objects(url)
    assert len(objects) > 20
    assert objects <= {p for p, data in synced.items() if data}, "every object is synced"
    parents = {os.path.dirname(p) for p in objects}
    assert parents <= {p for p, data in synced.items() if not data}, "and every directory naming one"
    assert events.index("commit") > max(i for i, e in enumerate(events) if e == "sync"), "all before the commit"
    _same(url, _state())


def test_a_failed_sync_fails_the_save_and_is_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failed fsync the kernel may have dropped the dirty pages and a second fsync succeeds:
    the save fails, uncommitted, instead of trusting a retry."""
    monkeypatch.setenv("ZARRCKPT_LOCAL_SYNC", "files")
    calls: list[str] = []

    def fdatasync(fd: int) -> None:
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    url = tmp_path / "ck"
    with pytest.raises(zarrckpt.StorageError, match=r"fsync of .* failed.*not committed"):
        zarrckpt.save(_state(), str(url))
    assert calls and len(calls) == len(set(calls)), f"a failed sync is not retried: {calls}"
    assert zarrckpt.list_checkpoints(tmp_path).get("ck") != "committed"
    monkeypatch.undo()
    zarrckpt.save(_state(), str(url), overwrite=True)  # the next save takes the leftovers over
    _same(url, _state())


def test_a_failed_syncfs_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZARRCKPT_LOCAL_SYNC", raising=False)
    calls: list[int] = []

    def syncfs(fd: int) -> int:
        calls.append(fd)
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(durable, "_syncfs_call", lambda: syncfs)
    url = tmp_path / "ck"
    with pytest.raises(zarrckpt.StorageError, match=r"syncfs of .* failed.*not committed"):
        zarrckpt.save(_state(), str(url))
    assert len(calls) == 1
    assert zarrckpt.list_checkpoints(tmp_path).get("ck") != "committed"


@pytest.mark.parametrize("how", ["transient", "permanent"])
def test_a_write_failing_half_way_leaves_no_torn_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The object is removed at once: a retry writes it whole (EIO is retried), and a failed save
    leaves no half object behind its name (ENOSPC is not)."""
    url = tmp_path / "ck"
    victim = str(url / "big" / "c.0.0")
    real_write, real_writev, failed = os.write, os.writev, []

    def fault(fd: int, first: Any) -> None:  # (a large object is written a part at a time, a small one by writev)
        if os.readlink(f"/proc/self/fd/{fd}") == victim and (how == "permanent" or not failed):
            failed.append(real_write(fd, bytes(first)[: len(first) // 2]))  # half of it lands
            raise OSError(errno.EIO if how == "transient" else errno.ENOSPC, "injected")

    def write(fd: int, data: Any) -> int:
        fault(fd, data)
        return real_write(fd, data)

    def writev(fd: int, buffers: Any) -> int:
        fault(fd, buffers[0])
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "writev", writev)
    if how == "transient":
        zarrckpt.save(_state(), str(url))
        assert failed, "the fault was injected"
        monkeypatch.undo()
        _same(url, _state())
        assert zarrckpt.open(str(url)).verify().ok
    else:
        with pytest.raises(zarrckpt.StorageError, match=r"No space|injected"):
            zarrckpt.save(_state(), str(url))
        assert failed and not os.path.exists(victim), "no torn object under its name"


def test_a_bad_sync_mode_fails_before_anything_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZARRCKPT_LOCAL_SYNC", "sometimes")
    url = tmp_path / "ck"
    with pytest.raises(zarrckpt.ZarrckptError, match=r"ZARRCKPT_LOCAL_SYNC='sometimes'.*syncfs, files"):
        zarrckpt.save(_state(), str(url))
    assert not _objects(url)


def test_directories_under_an_ancestor_that_refuses_mkdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An existing ancestor on a read-only mount answers mkdir with EROFS, not EEXIST: still fine."""
    real = os.mkdir

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.path.isdir(path):
            raise OSError(errno.EROFS, "Read-only file system", path)
        real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    url = tmp_path / "ck"
    zarrckpt.save(_state(), str(url))
    monkeypatch.undo()
    _same(url, _state())


@pytest.mark.parametrize("vectored", [True, False], ids=["writev", "a write per part"])
@pytest.mark.parametrize("most", [1, 7, 4096])
def test_short_writes_are_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, most: int, vectored: bool) -> None:
    """write_parts writes every byte of its parts (bytes, and views of other item sizes) whatever
    each call writes: in one vectored call (small objects) or a part at a time (large ones)."""
    import numpy as np

    from zarrckpt.storage.durable import write_parts

    if not vectored:
        monkeypatch.setattr(durable, "VECTORED_BYTES", 0)

    real_write, real_writev = os.write, os.writev

    def write(fd: int, data: Any) -> int:
        return real_write(fd, memoryview(data).cast("B")[:most])

    def writev(fd: int, buffers: Any) -> int:
        first = next(b for b in (memoryview(b).cast("B") for b in buffers) if len(b))
        return real_writev(fd, [first[:most]])

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "writev", writev)
    floats = np.arange(1000, dtype=np.float32)
    cases = ([b"a" * 5000], [b"index", memoryview(floats), b"", b"crc!"], [memoryview(floats[:3])], [])
    for i, parts in enumerate(cases):
        path = tmp_path / f"f{i}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        try:
            write_parts(fd, parts)
        finally:
            os.close(fd)
        assert path.read_bytes() == b"".join(bytes(memoryview(p).cast("B")) for p in parts)


def test_parent_of_is_dirname() -> None:
    from zarrckpt.storage.durable import parent_of

    for path in ("/a/b/c", "/a", "a/b", "a", "/", "//a", "/a//b", "/tmp/x/zarr.json", ""):
        assert parent_of(path) == os.path.dirname(path), path


def _state_of(n: int, numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {f"t{i}": torch.randn(numel, generator=g) for i in range(n)}


def test_write_back_starts_while_the_save_still_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if durable._syncfs_call() is None:
        pytest.skip("no syncfs in this C library")
    monkeypatch.delenv("ZARRCKPT_LOCAL_SYNC", raising=False)
    # early syncs every 64 KiB, one at a time on a thread of their own, joined before the writes end;
    # the barrier still runs, on the saving thread (how many early ones fit depends on the machine's load)
    monkeypatch.setattr(durable, "EARLY_SYNC_BYTES", 64 * 1024)
    real, events = durable._syncfs, []
    lock, running = threading.Lock(), [0, 0]  # now, most at once

    def syncfs(path: str) -> None:
        name = threading.current_thread().name
        if name == "zarrckpt-sync":
            with lock:
                running[0] += 1
                running[1] = max(running)
            time.sleep(0.01)
            with lock:
                running[0] -= 1
        events.append(("sync", name))
        real(path)

    monkeypatch.setattr(durable, "_syncfs", syncfs)
    real_commit = commit.commit
    monkeypatch.setattr(commit, "commit", lambda *a, **k: (events.append(("commit", "")), real_commit(*a, **k))[1])
    state = _state_of(40, 4096)  # 640 KiB of shards
    zarrckpt.save(state, tmp_path / "ck")
    early = [e for e in events if e == ("sync", "zarrckpt-sync")]
    assert len(early) >= 1 and running[1] == 1, (events, running)
    assert events[-2:] == [("sync", "MainThread"), ("commit", "")], events  # the barrier, then the commit
    assert not [t for t in threading.enumerate() if t.name == "zarrckpt-sync"]
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    zarrckpt.load(target, tmp_path / "ck")
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_a_failed_early_sync_fails_the_save_though_the_barrier_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if durable._syncfs_call() is None:
        pytest.skip("no syncfs in this C library")
    monkeypatch.delenv("ZARRCKPT_LOCAL_SYNC", raising=False)
    # errors of write-back reach the first syncfs that sees them: the barrier's own may then succeed
    monkeypatch.setattr(durable, "EARLY_SYNC_BYTES", 64 * 1024)
    real = durable._syncfs

    def syncfs(path: str) -> None:
        if threading.current_thread().name == "zarrckpt-sync":
            raise durable._failed("syncfs", path, OSError(errno.EIO, os.strerror(errno.EIO)))
        real(path)

    monkeypatch.setattr(durable, "_syncfs", syncfs)
    with pytest.raises(zarrckpt.StorageError, match=r"syncfs of .* failed"):
        zarrckpt.save(_state_of(40, 4096), tmp_path / "ck")
    assert not [t for t in threading.enumerate() if t.name == "zarrckpt-sync"]
    with pytest.raises(zarrckpt.IncompleteCheckpointError):
        zarrckpt.load(_state_of(40, 4096), tmp_path / "ck")


def test_files_mode_starts_no_early_write_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZARRCKPT_LOCAL_SYNC", "files")
    monkeypatch.setattr(durable, "EARLY_SYNC_BYTES", 1)
    calls: list[str] = []
    monkeypatch.setattr(durable, "_syncfs", lambda path: calls.append(path))
    zarrckpt.save(_state_of(10, 4096), tmp_path / "ck")
    assert calls == []
